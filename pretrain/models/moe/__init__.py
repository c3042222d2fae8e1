"""Mixture-of-experts MLP (Megatron's ``--num-experts``): a top-k router, routed experts and an
optional shared expert, all tensor-parallel like the dense MLP."""

"""Model-parallel checkpoints in every format we read and write, as canonical full tensors.

Rooms, by concern (each reader yields the shared :class:`~pretrain.checkpoint.types.TensorSource`):

* top level -- what every format shares: :mod:`~pretrain.checkpoint.types` (the typed records and
  the reader protocol), :mod:`~pretrain.checkpoint.metadata` / :mod:`~pretrain.checkpoint.args`
  (the Megatron-named ``args`` and our record inside), :mod:`~pretrain.checkpoint.plan` (what each
  rank file of a layout holds), :mod:`~pretrain.checkpoint.opener` (the one entry point that
  dispatches to a format's reader), :mod:`~pretrain.checkpoint.safe_unpickle` (the restricted
  unpickler for untrusted files), :mod:`~pretrain.checkpoint.verify`,
  :mod:`~pretrain.checkpoint.fingerprint` and :mod:`~pretrain.checkpoint.work_split` (which
  process of a ``torchrun`` conversion writes which output file);
* :mod:`~pretrain.checkpoint.legacy` -- Megatron's legacy per-rank ``torch`` format: paths, the
  reader, the streaming writer, per-rank save/load for training, module names, page release;
* :mod:`~pretrain.checkpoint.torch_dist` -- megatron-core's ``torch_dist`` (PyTorch distributed
  checkpoint) format: reader, writer, its optimizer state, dcp failures as our errors;
* :mod:`~pretrain.checkpoint.upstream` -- upstream Megatron-LM's names, ``args`` and optimizer
  layout read into ours;
* :mod:`~pretrain.checkpoint.optimizer` -- optimizer state as canonical tensors, and its reshard.
"""

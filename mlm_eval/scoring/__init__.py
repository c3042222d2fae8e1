"""Scorers: what turns token batches into per-target log-probabilities, for every evaluation.

:mod:`.scorer` is the ``LMScorer`` interface every task runs against and its Hugging Face
adapter; :mod:`.vocab` scores hidden states at selected positions under any TP degree;
:mod:`.megatron` loads a checkpoint of any layout into one process, :mod:`.parallel` under
``torchrun`` (TP x PP x DP); :mod:`.model_loading` is the ``--hf-model``/``--ckpt`` flags and
``load_scorer``, which picks among them.
"""

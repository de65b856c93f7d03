"""One replica of the inference service: a paged continuous-batching engine on torch.

Bookkeeping (``sequence``, ``kv_blocks``, ``scheduler``, ``sampling_params``, ``config``) imports no
torch; tensor work lives in ``model_runner``, ``attention`` and ``models``.
"""

"""One replica of the inference service: a paged continuous-batching engine on torch.

Bookkeeping (``sequence``, ``kv_blocks``, ``scheduler``, ``sampling_params``, ``config``) imports no
torch; tensor work lives in ``model_runner``, ``attention`` and ``models``.
"""

import os

# torch >= 2.5 imports out-of-tree backends such as torch_npu at `import torch`; without Huawei's CANN
# libraries that import fails and takes torch down with it. inference.device imports torch_npu itself,
# guarded, when it is usable.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

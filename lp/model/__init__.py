"""The one folder that touches transformers models: loading, the packed forward, its kernels and caches.

Knows: loading a checkpoint (``loader``), running a packed step through the model's public
forward with explicit positions and a 4-D mask (``runner``), attention kernels (``attention``,
the row-exact one in ``exact_attention``), small-row and packed matmuls (``kernels``), the LM
head's greedy screen (``head``), int8/int4 weights (``quant``), linears on exact 4-bit blocks with
their C++ kernel (``exact4``, ``csrc/lp_exact4.cpp``), the static packed K/V cache
(``kv``) and the paged pool (``paged``), CUDA-graph
stepping (``graphs``), the measured t(Q) curve (``calibrate``), and transformers
``generate``'s processors for the same logits settings (``hf_generate``).
Imports: lp.lookahead (layouts; lp.drafts and lp.config are allowed, unused today). Never imports
torch.distributed, lp.parallel, lp.engine or lp.server: parallelism is applied to a model
from outside (lp.parallel.tp), and a collective the calibration needs is handed in by it.
"""

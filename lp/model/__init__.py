"""The one folder that adapts transformers models: loading, the packed forward, its caches.

Knows: loading a checkpoint (``loader``; a GGUF file as stored, ``gguf``; the loaded model kept and mapped
on a restart, ``packed``; a kept tokenizer loaded as its JSON, ``tokenizer``), running a packed step through the model's public
forward with explicit positions and a 4-D mask (``runner``), int8/int4 weights and the choice of
``model.quant`` (``quant``), the static packed K/V cache (``kv``) and the paged pool (``paged``),
CUDA-graph stepping (``graphs``), the measured t(Q) curve (``calibrate``), and transformers
``generate``'s processors for the same logits settings (``hf_generate``). The kernels these run
(linears, exact blocks, the fused stack, the head, attention, their C++ sources) live in
lp.kernels.
Imports: lp.kernels, lp.lookahead (layouts; lp.drafts and lp.config are allowed, unused today).
Never imports torch.distributed, lp.parallel, lp.engine or lp.server: parallelism is applied to a
model from outside (lp.parallel.tp), and a collective the calibration needs is handed in by it.
"""

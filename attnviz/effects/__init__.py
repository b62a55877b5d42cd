"""What a mask does to the model, one module per analysis: evaluation (``evaluate``), streaming with a KV cache
(``streaming``), generation (``generate``), embeddings (``embedding``), the Linformer what-if (``linformer``), head
classes (``heads``), induction, previous-token, duplicate and dormant heads on repeated random tokens
(``induction``), sinks over a dataset (``dataset``), A-vs-B measures (``compare``), the causal check and scan
(``causal``), path patching (``paths``, with heads as receivers in ``receivers``), activation patching
(``patching``), score attribution and the sink's
diagnosis (``explain`` over ``attribution`` and ``schemes``), fine-tuning (``finetune``), the walkthrough
(``walkthrough``) and the compression valley (``valley``). The scan, path patching, activation patching and score
attribution open a text the same way, once (``opening``), and are sized before they run within the memory
budget (``budget``). Each is listed with its files in docs/layout.md; the
commands that run them are ``attnviz.cli.COMMANDS``."""

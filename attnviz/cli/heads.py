"""``attnviz heads``: head classes (sink, streaming, inactive) of one text or averaged over a dataset
(docs/methods.md#head-classes), and beside them the induction, previous-token, duplicate-token and dormant heads on
repeated random tokens (docs/methods.md#induction-previous-token-and-duplicate-heads, ``repeated`` in the JSON)."""

from __future__ import annotations

from attnviz.cli import common
from attnviz.errors import AttnvizError


def options(p):
    from attnviz import defaults
    from attnviz.effects import heads

    from attnviz.effects import induction

    run_, texts, rep = defaults.of(heads.taxonomy), defaults.of(heads.dataset_texts), defaults.of(induction.repeated)
    common.model_args(p, text=False).add_argument("--text", help="one text (default: the stdlib corpus as a dataset)")
    p.set_defaults(corpus=None)
    p.add_argument("--samples", type=int, default=texts["samples"], help="dataset mode: at most N samples "
                                                                         "(%(default)s)")
    p.add_argument("--max-len", type=int, default=texts["max_len"],
                   help="dataset mode: first N tokens of each sample (%(default)s)")
    p.add_argument("--eps", type=float, default=run_["eps"], help="sink threshold on alpha_0 (%(default)s)")
    p.add_argument("--tau-stream", type=float, default=run_["tau_stream"],
                   help="streaming-score threshold (%(default)s)")
    p.add_argument("--tau-inactive", type=float, default=run_["tau_inactive"],
                   help="output-norm (AHON) threshold (%(default)s)")
    p.add_argument("--sink", type=int, default=run_["s"], help="s: sink keys of the streaming pattern (%(default)s)")
    p.add_argument("--window", type=int, default=run_["w"],
                   help="w: recent keys of the streaming pattern (%(default)s)")
    p.add_argument("--repeat", type=int, default=rep["length"],
                   help="L: the repeated random tokens' segment, BOS r_1..r_L r_1..r_L (%(default)s)")
    p.add_argument("--repeat-samples", type=int, default=rep["samples"],
                   help="sequences of repeated random tokens to average over (%(default)s)")
    p.add_argument("--seed", type=int, default=rep["seed"], help="seed of the random tokens (%(default)s)")
    p.add_argument("--tau", type=float, default=rep["tau"],
                   help="induction, previous-token and duplicate score threshold (%(default)s)")
    p.add_argument("--dormant-share", type=float, default=rep["share"],
                   help="a dormant head's quiet output under this share of its active median (%(default)s)")


def run(args) -> dict:
    from attnviz.effects import heads, induction

    for name in ("eps", "tau_stream", "tau_inactive", "tau", "dormant_share"):
        if getattr(args, name) < 0:
            raise AttnvizError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.samples is not None and args.samples < 2:
        raise AttnvizError(f"--samples must be at least 2 (a dataset's scores are averaged), got {args.samples}")
    dataset = not (args.text or args.text_file)  # one text given: that text; else the corpus as a dataset
    source = common.corpus(args)
    loaded = common.load(args)
    texts = (heads.dataset_texts(loaded, source.documents, args.samples, args.max_len) if dataset
             else [source.text])
    bar, update = common.progress("heads")
    with bar:
        common.kindless(args, "head classes")
        result = heads.taxonomy(loaded, texts, args.arch, args.sink, args.window, args.eps, args.tau_stream,
                                args.tau_inactive, on_progress=update)
        repeated = induction.repeated(loaded, args.arch, args.repeat, args.repeat_samples, args.seed, args.tau,
                                      args.eps, args.dormant_share)
    return {**result.as_json(), "repeated": repeated.as_json()}

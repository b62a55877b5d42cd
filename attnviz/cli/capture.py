"""``attnviz capture``: attention maps saved as a .npz capture; of an encoder-decoder, its three stacks."""

from __future__ import annotations

from pathlib import Path

from attnviz.cli import common
from attnviz.errors import AttnvizError


def options(p):
    common.model_args(p)
    common.intervene_args(p, bos=True)
    p.add_argument("--out", required=True, help="output file (.npz)")
    p.add_argument("--layers", default=None, help="layers to record: 5, -1, 20-29 or 0,5,7 (default: all)")
    p.add_argument("--hidden", action="store_true", help="also keep hidden states")
    p.add_argument("--residual", default=None, help=common.RESIDUAL_HELP)
    p.add_argument("--attention", choices=["self", "encoder", "decoder", "cross", "all"], default=None,
                   help="encoder-decoder models: which attention to save (default all, one .npz each)")
    p.add_argument("--target", default=None,
                   help="encoder-decoder models: the target text (default: the model's own greedy output)")
    p.set_defaults(arch=None)  # fwd for decoders; the stock bidir encoder for encoder-decoders


def run(args) -> dict:
    from attnviz.capture import capture
    from attnviz.plan import Keep

    text = common.text(args)
    common.check_intervene(args)
    loaded = common.load(args)
    if loaded.is_encoder_decoder or args.attention not in (None, "self"):
        if args.intervene or common.prepend(args):
            raise AttnvizError("--intervene, --bos and --prepend are for decoder-only models")
        return _seq2seq(args, loaded, text)
    result = capture(loaded, text, common.recipe(args, loaded), Keep(layers=args.layers, hidden_states=args.hidden))
    path = result.save(args.out)
    return {"out": str(path), **result.as_json()}


def _seq2seq(args, loaded, text) -> dict:
    """Encoder-decoders: the three stacks (or the one asked for), one .npz each."""
    from attnviz import seq2seq

    seq2seq.require(loaded)
    if args.attention == "self":
        raise AttnvizError("--attention self is for decoder-only models; choose encoder, decoder, cross or all")
    bar, update = common.progress("capture")
    with bar:
        result = seq2seq.capture_seq2seq(loaded, text, args.target, args.arch or seq2seq.STOCK_ENCODER,
                                         on_layer=update)
    stacks = list(seq2seq.STACKS) if args.attention in (None, "all") else [args.attention]
    out = Path(args.out)
    stem = out.name.removesuffix(".npz")
    paths = {s: str(result.view(s).save(out if len(stacks) == 1 else out.with_name(f"{stem}.{s}.npz"))) for s in stacks}
    return {"out": paths, **result.as_json()}

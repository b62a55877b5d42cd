"""Several visitors' forwards on ONE loaded model at once, as the shared server runs them (docs/sharing.md): every
capability that reads or replaces activations does so at the engine's named sites (docs/methods.md#sites), which
act only in the thread that asked. Two threads, held at a barrier so that their forwards overlap, each run one
capability on its own text a few times; each thread's every result equals the same call run alone."""

import dataclasses
import threading

import numpy as np
import pytest

import tiny

REPEATS = 3
# two texts of different lengths (one token per character on the tiny models): a function of one thread that
# fired in the other's forward would read a stream of the wrong length, or the other text's numbers
TEXTS = ("The keeper lit the lamp at dusk and watched the ships pass the rocks below.",
         "A cat sat on the mat by the door.")


def _plain(value):
    """A result as plain data: dataclasses and objects by their fields, tensors as arrays."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "detach"):
        return value.detach().cpu().numpy()
    if isinstance(value, (str, int, float, bool, np.ndarray, np.generic)) or value is None:
        return value
    return _plain(vars(value)) if hasattr(value, "__dict__") else value


def _assert_same(got, want, where="result"):
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), f"{where}: {list(got)} != {list(want)}"
        for k in want:
            _assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {len(got)} != {len(want)} items"
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, (float, np.ndarray, np.floating)) and not isinstance(want, bool):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=where)
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _together(call, inputs):
    """``call(x)`` for each of ``inputs`` in its own thread, all started together, :data:`REPEATS` times each (a
    barrier before each round): every thread's results, or the first thread's error raised here."""
    barrier = threading.Barrier(len(inputs))
    results: dict = {}
    errors: list = []

    def work(i, x):
        try:
            for _ in range(REPEATS):
                barrier.wait(timeout=600)
                results.setdefault(i, []).append(_plain(call(x)))
        except threading.BrokenBarrierError:
            pass
        except BaseException as error:  # noqa: BLE001: raised in the test's thread below
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(i, x), daemon=True) for i, x in enumerate(inputs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return [results[i] for i in range(len(inputs))]


def _agree(call, inputs):
    alone = [_plain(call(x)) for x in inputs]
    for x, want, got in zip(inputs, alone, _together(call, inputs)):
        for round_, result in enumerate(got):
            _assert_same(result, want, f"{x!r} round {round_}")


# each case: the model, the call on one input, the inputs of the two threads
def _explain(lm):
    from attnviz import explain

    layer = lm.n_layers - 1
    return lambda text: explain(lm, text, layer=layer, head=1, query=20, key=3).as_json(), TEXTS


def _trace(lm):
    from attnviz.flow import trace

    def call(text):
        flow = trace(lm, text, floor=0.0)
        flow.meta.pop("seconds")  # the one entry that differs from run to run
        return flow
    return call, TEXTS


def _scan(lm):
    from attnviz.effects import causal

    return lambda text: causal.scan(lm, text).as_json(), TEXTS


def _patching(lm):
    from attnviz.effects.patching import patching

    pairs = (("The cat sat on the mat and", "The dog sat on the hat and"),
             ("A keeper lit the lamp at dusk", "A sailor lit the fire at dawn"))
    return lambda pair: patching(lm, *pair, "P", "R", site="resid"), pairs


def _paths(lm):
    from attnviz.effects import paths

    return lambda text: paths.paths(lm, text, senders=["mlp.0"], receivers="groups").as_json(), TEXTS


CASES = {"explain": _explain, "trace": _trace, "causal scan": _scan, "patching": _patching, "path patching": _paths}


@pytest.mark.parametrize("case", list(CASES))
def test_two_threads_on_one_model_each_get_their_own_result(case):
    call, inputs = CASES[case](tiny.loaded("llama"))
    _agree(call, inputs)


def test_score_attribution_of_the_default_model_in_two_threads(default_model):
    """The shared server's case: layer 20, head 3 of the default model, two visitors' texts at once."""
    from attnviz import explain

    call = lambda text: explain(default_model, text, layer=20, head=3, query="all", key=0).as_json()  # noqa: E731
    _agree(call, TEXTS)


def _hidden_ids(lm, text="The cat sat on the mat."):
    import torch

    return torch.tensor([lm.tokenizer(text)["input_ids"]])


def _forward_in_another_thread(model, ids):
    """The logits of one plain forward run in a thread of its own, or that thread's error raised here."""
    out: list = []

    def work():
        try:
            out.append(model(input_ids=ids).logits.detach().clone())
        except BaseException as error:  # noqa: BLE001: raised in the test's thread below
            out.append(error)
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


@pytest.mark.parametrize("name", ["resid_pre", "attn_in", "resid_mid"])
def test_a_forward_in_another_thread_while_torch_marks_a_hook_as_taking_keywords_is_untouched(name):
    """torch adds a pre-hook and, a step later, marks it as taking keyword arguments (and unmarks it a step after
    removing it); a forward in another thread between the two steps calls it without them. Held at that step here:
    the other thread's forward is the plain one, and nothing raises."""
    import torch

    from attnviz.core.engine import sites

    lm = tiny.loaded("llama")
    ids = _hidden_ids(lm)
    with torch.no_grad():
        plain = lm.model(input_ids=ids).logits
        with sites.hooks(lm.model, [(sites.site(name, 1), lambda v: v * 0.5)]):
            hooked = lm.model(input_ids=ids).logits
            module = sites._where(lm.model, sites.site(name, 1))[0]
            marked = module._forward_pre_hooks_with_kwargs
            ours = [key for key in marked if key in module._forward_pre_hooks]
            assert ours, "the site's pre-hook is registered as taking keywords"
            for key in ours:
                del marked[key]  # the moment between torch's two steps
            other = _forward_in_another_thread(lm.model, ids)
            mine = lm.model(input_ids=ids).logits
    assert not torch.allclose(hooked, plain)
    torch.testing.assert_close(other, plain, rtol=0, atol=0)
    # in the thread that registered it (an engine function registered for every thread, :func:`sites.install`): a
    # value passed by position is still replaced; one passed by keyword (the attention's input) is not seen that once
    torch.testing.assert_close(mine, plain if name == "attn_in" else hooked, rtol=0, atol=0)


def test_the_anatomy_probe_reads_its_own_forward_not_another_thread_s():
    """The probe hooks every layer of a model the server may share: a forward of another thread during it (here, run
    after the probe's own forward, before its hooks are removed) changes nothing the probe records."""
    import torch

    from attnviz.core.model import anatomy, probe as probe_mod

    lm = tiny.loaded("llama")
    config = anatomy._config(lm.model)
    base, layers = anatomy._layer_list(lm.model, config)
    n = int(config.num_hidden_layers)
    args = (layers, n, anatomy._attention, anatomy._mlp, anatomy._is_norm, config)
    alone, _ = probe_mod.probe(lm.model, base, *args)
    longer = _hidden_ids(lm, "A much longer text than the probe's own few tokens, run in another thread.")

    def interleaved(**kwargs):
        out = base(**kwargs)
        _forward_in_another_thread(lm.model, longer)  # while the probe's hooks are still in place
        return out
    beside, _ = probe_mod.probe(lm.model, interleaved, *args)
    for index, (a, b) in enumerate(zip(alone, beside)):
        assert set(a) == set(b), index
        for key in ("layer_in", "layer_out", "attn_in", "attn_out", "mlp_in", "mlp_out"):
            torch.testing.assert_close(b[key], a[key], rtol=0, atol=0, msg=f"layer {index} {key}")


@pytest.mark.parametrize("where", ["sites", "capture"])
def test_an_error_in_a_forward_comes_out_as_itself_while_another_thread_changes_the_hooks(where):
    """After an error in a module's forward torch loops over the module's forward hooks without a copy: another
    thread adding a hook there at that moment (played here by a hook torch calls in that loop) turns the error into
    "OrderedDict mutated during iteration". Inside the engine's sites, and in any run of the engine, the error comes
    out as itself: a refusal stays a refusal."""
    import torch

    from attnviz.core.engine import sites
    from attnviz.core.model import anatomy
    from attnviz.errors import InputError

    lm = tiny.loaded("llama")
    ids = _hidden_ids(lm)
    module = anatomy.of(lm.model)[1].module
    added = []

    def refuse(value):
        raise InputError("a planted refusal")

    def another_thread(mod, args, out):  # torch runs it in its clean-up loop, after the error
        added.append(mod.register_forward_hook(lambda *a: None))

    def run():
        # after the refusing function, and not the last (torch's loop stops quietly after its last hook)
        handles = [module.register_forward_hook(another_thread, always_call=True),
                   module.register_forward_hook(lambda *a: None)]
        try:
            if where == "sites":
                lm.model(input_ids=ids)
            else:  # a run of the engine (its recorders, its masks), the function registered as torch's own hook
                from attnviz.capture import capture

                capture(lm, "The cat sat on the mat.", "fwd")
        finally:
            for handle in handles:
                handle.remove()

    with pytest.raises(InputError, match="a planted refusal"), torch.no_grad():
        if where == "sites":
            with sites.hooks(lm.model, [(sites.site("resid_post", 1), refuse)]):
                run()
        else:
            first = module.register_forward_hook(lambda mod, args, out: refuse(out))
            try:
                run()
            finally:
                first.remove()
    assert added, "the clean-up loop ran the hook that changes the module's hooks"
    for extra in added:
        extra.remove()

"""shims.custom_loss.graph / shims.custom_loss.run: graphs the SDK traces run exactly as the SDK runs them
client-side, and hostile graphs are user errors, never code execution, attribute access or unbounded memory."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tinker import types
from tinker.lib.public_interfaces.custom_loss import encode_graph, run_loss_handle, trace_loss
from tinker.proto.request_conv import forward_backward_request_to_proto

from shims.custom_loss import ops
from shims.custom_loss.batch import CustomLossBatch, combined_metrics
from shims.custom_loss.graph import CustomLossLimits, compile_custom_loss
from shims.custom_loss.run import check_custom_datum, run_datum
from shims.errors import UserError
from shims.tinker.training_wire import DatumLimits, decode_forward_backward

LIMITS = CustomLossLimits()


def dpo(logprobs, chosen_mask, rejected_mask, ref_logprobs, beta):
    policy = (logprobs * chosen_mask).sum() - (logprobs * rejected_mask).sum()
    reference = (ref_logprobs * chosen_mask).sum() - (ref_logprobs * rejected_mask).sum()
    margin = beta * (policy - reference)
    return -F.logsigmoid(margin), {"custom/accuracy:mean": (margin > 0).float(), "custom/margin:mean": margin.detach(),
                                   "custom/pairs:sum": torch.ones_like(margin)}


def assorted(logprobs, weights, target_tokens):
    x = torch.clamp(logprobs, min=-10.0, max=float("inf"))
    y = x[1:] * weights[:-1]
    z = y.mean(dim=0, keepdim=True) + math.log(2) + logprobs.shape[0]
    s = torch.where(weights > 0, x, torch.zeros_like(x)).softmax(-1)
    q = F.softplus(z).exp().log1p().to(torch.float32).view(-1)[..., None]
    top = torch.topk(x, 2).values.sum() + x.max(dim=0).values
    picked = x[target_tokens % 3]  # indexing by an integer tensor
    loss = q.sum() + s.sum() + torch.logsumexp(x, dim=0) + x.abs().max() ** 2 + top + picked.mean()
    return loss, {"custom/tokens:sum": (target_tokens >= 0).sum(), "custom/n:mean": logprobs.size(0) * 1.0}


RANKS = {dpo: {"logprobs": 1, "chosen_mask": 1, "rejected_mask": 1, "ref_logprobs": 1, "beta": 0},
         assorted: {"logprobs": 1, "weights": 1, "target_tokens": 1}}


def traced(fn):
    handle = trace_loss(fn, RANKS[fn], "session")
    return handle, compile_custom_loss(handle.name, handle.inputs, encode_graph(handle).nodes, LIMITS)


def datum_inputs(fn, n: int, rng: np.random.Generator) -> dict[str, torch.Tensor]:
    made = {"chosen_mask": (rng.random(n) > 0.5), "rejected_mask": (rng.random(n) > 0.5),
            "ref_logprobs": -rng.exponential(size=n), "beta": np.array(0.1), "weights": rng.normal(size=n),
            "target_tokens": rng.integers(0, 500, size=n)}
    return {name: torch.tensor(made[name].astype(np.int64 if name == "target_tokens" else np.float32))
            for name in RANKS[fn] if name != "logprobs"}


@pytest.mark.parametrize("fn", [dpo, assorted])
def test_traced_losses_give_the_sdk_client_side_loss_metrics_and_gradient(fn):
    handle, loss = traced(fn)
    rng = np.random.default_rng(0)
    lengths = (5, 9, 3)
    inputs = [datum_inputs(fn, n, rng) for n in lengths]
    logprobs = [torch.tensor(-rng.exponential(size=n), dtype=torch.float32, requires_grad=True) for n in lengths]
    data = [types.Datum(model_input=types.ModelInput.from_ints([1] * n),
                        loss_fn_inputs={"target_tokens": np.zeros(n, np.int64),
                                        **{k: v.numpy() for k, v in ins.items()}}) for n, ins in zip(lengths, inputs)]
    client_loss, client_metrics = run_loss_handle(handle, data, logprobs)
    client_grads = torch.autograd.grad(client_loss, logprobs)

    batch = CustomLossBatch(loss, torch.device("cpu"))
    server_loss = sum(batch.datum(lp, ins) for lp, ins in zip(logprobs, inputs))
    server_grads = torch.autograd.grad(server_loss, logprobs)
    assert float(server_loss.detach()) == float(client_loss.detach())
    assert combined_metrics([batch.tally()]) == pytest.approx(client_metrics, rel=1e-6)
    assert set(combined_metrics([batch.tally()])) == set(client_metrics)
    for a, b in zip(server_grads, client_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def node(op, name, target, args=(), kwargs=None):
    return SimpleNamespace(op=op, name=name, target=target, args=list(args), kwargs=kwargs or {})


INPUTS = [types.CustomLossInput(name="logprobs", rank=1)]
X = {"ref": "logprobs"}


def graph(*steps, output=None):
    """logprobs → steps → (output or the last step, {})."""
    last = {"ref": steps[-1].name} if steps else X
    return [node("placeholder", "logprobs", "logprobs"), *steps,
            node("output", "output", "output", [{"tuple": [output or last, {"dict": {}}]}])]


def refused(nodes, *fragments, limits=LIMITS, inputs=INPUTS):
    with pytest.raises(UserError) as info:
        compile_custom_loss("hostile", inputs, nodes, limits)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize("target", ["builtins.eval", "builtins.exec", "os.system", "subprocess.run", "torch.load",
                                    "pickle.loads", "builtins.__import__", "torch.zeros", "torch.arange",
                                    "torch.outer", "torch.matmul", "torch.nn.functional.pad", "torch.Tensor.add_",
                                    "torch.nn.functional.relu", "torch.norm", "importlib.import_module"])
def test_functions_outside_the_allow_list_are_refused(target):
    refused(graph(node("call_function", "f", target, [X])), "is not a function this server runs")


@pytest.mark.parametrize("method", ["backward", "item", "tolist", "numpy", "add_", "copy_", "register_hook",
                                    "__class__", "__reduce__", "repeat", "expand", "new_zeros", "cuda", "data_ptr"])
def test_methods_outside_the_allow_list_are_refused(method):
    refused(graph(node("call_method", "m", method, [X])), f"tensor method {method!r} is not allowed")


@pytest.mark.parametrize("attribute", ["__class__", "__dict__", "grad", "data", "_base", "__globals__", "storage"])
def test_attribute_access_is_refused(attribute):
    refused(graph(node("call_function", "a", "getattr", [X, attribute])), "only the attributes")
    refused(graph(node("call_function", "a", "builtins.getattr", [X, attribute])), "only the attributes")


def test_attributes_only_of_graph_values_and_only_where_they_exist():
    refused(graph(node("call_function", "a", "getattr", ["torch", "shape"])), "only from a value of the graph")
    refused(graph(node("call_function", "a", "getattr", [X, ["shape"]])), "only the attributes")
    refused(graph(node("call_method", "m", "sum", [1.0])), "must be called on a value of the graph")
    # "values" is an attribute of max(dim)'s result, not of a tensor
    loss = compile_custom_loss("a", INPUTS, graph(node("call_function", "a", "getattr", [X, "values"])), LIMITS)
    with pytest.raises(UserError, match="cannot be read from a Tensor"):
        run_datum(loss, torch.zeros(3), {})


@pytest.mark.parametrize("op", ["get_attr", "call_module", "eval", "import"])
def test_node_kinds_other_than_functions_and_methods_are_refused(op):
    refused(graph(node(op, "n", "torch.exp", [X])), "nodes are not allowed")


@pytest.mark.parametrize("constant, message", [
    ({"pickle": "gASVAAAA"}, "is not allowed here"),
    ({"dtype": "complex128"}, "is not allowed here"),
    ({"dtype": "__class__"}, "is not allowed here"),
    ({"device": "disk"}, "is not allowed here"),
    ({"float": "1e400"}, "is not allowed here"),
    ({"dict": {"a": 1}}, "only allowed as the metrics"),
    ({"ref": "logprobs", "extra": 1}, "unreadable argument"),
    ("x" * 300, "longer than 256"),
    (2**70, "does not fit in 64 bits"),
    pytest.param(10**5000, "does not fit in 64 bits", id="int-of-5000-digits"),
    ({"float": [[[1]]]}, "is not allowed here"),
    ({"ref": [[["x"]]]}, "not an earlier node"),
    (list(range(5000)), "more than 4096 constants"),
])
def test_constants_are_checked(constant, message):
    refused(graph(node("call_function", "f", "torch.add", [X, constant])), message)


def test_deep_nesting_is_refused_without_recursing_into_it():
    deep: object = 1
    for _ in range(100_000):
        deep = [deep]
    refused(graph(node("call_function", "f", "torch.add", [X, deep])), "nest deeper than 8 levels")
    refused(graph(node("call_function", "f", "torch.add", [X, [[[1]]]])), "nest deeper than 2",
            limits=CustomLossLimits(max_nesting=2))


def test_cycles_and_forward_references_are_refused():
    refused(graph(node("call_function", "a", "torch.exp", [{"ref": "a"}])), "not an earlier node", "no cycles")
    refused(graph(node("call_function", "a", "torch.exp", [{"ref": "b"}]),
                  node("call_function", "b", "torch.exp", [{"ref": "a"}])), "not an earlier node")
    refused(graph(node("call_function", "a", "torch.exp", [{"ref": "output"}])), "not an earlier node")
    refused(graph(node("call_function", "a", "torch.exp", [X]), node("call_function", "a", "torch.exp", [X])),
            "unique")


def test_graph_size_and_shape_limits():
    chain = [node("call_function", f"n{i}", "torch.exp", [X]) for i in range(1000)]
    refused(graph(*chain), "at most 1000 (--custom-loss-max-nodes)")
    refused(graph(node("call_function", "f", "torch.add", [X, list(range(10))])), "more than 5 constants",
            limits=CustomLossLimits(max_constants=5))
    no_output = graph(node("call_function", "a", "torch.exp", [X]))[:-1]
    refused(no_output, "no output node")
    late = graph()
    refused([*late, node("call_function", "z", "torch.exp", [X])], "output node must be the last")
    refused(graph(), "placeholders must be its inputs", inputs=[*INPUTS, types.CustomLossInput(name="w", rank=1)])
    refused(graph(node("call_function", "f", "torch.exp", [X], {"out": X})), "out= and inplace=")
    refused(graph(node("call_function", "f", "torch.nn.functional.softplus", [X], {"inplace": True})),
            "out= and inplace=")


@pytest.mark.parametrize("metrics, message", [
    ({"dict": {"loss:sum": X}}, "custom/<name>:sum"),
    ({"dict": {"custom/a:max": X}}, "custom/<name>:sum"),
    ({"dict": {"custom/a:sum": 1.0}}, "must be a value the loss computes"),
    ("nope", "must return (loss, metrics)"),
])
def test_the_output_must_be_a_loss_and_named_metrics(metrics, message):
    nodes = [node("placeholder", "logprobs", "logprobs"), node("output", "output", "output", [{"tuple": [X, metrics]}])]
    refused(nodes, message)


def test_declared_inputs_are_checked():
    for inputs, message in [([], "must start with logprobs"), ([types.CustomLossInput(name="logprobs", rank=0)],
                                                                "rank 1"),
                            ([*INPUTS, SimpleNamespace(name="Bad Name", rank=1)], "lowercase name"),
                            ([*INPUTS, SimpleNamespace(name="w", rank=3)], "rank 0, 1 or 2"),
                            ([*INPUTS] * 2, "repeat")]:
        refused(graph(), message, inputs=inputs)


def run_graph(*steps, limits=LIMITS, logprobs=None, output=None):
    loss = compile_custom_loss("l", INPUTS, graph(*steps, output=output), limits)
    return run_datum(loss, torch.zeros(8) if logprobs is None else logprobs, {})


def test_memory_is_bounded_before_a_step_allocates():
    small = CustomLossLimits(max_elements=5000)
    outer = [node("call_method", "a", "unsqueeze", [X, 0]), node("call_method", "b", "unsqueeze", [X, 1]),
             node("call_function", "c", "operator.mul", [{"ref": "a"}, {"ref": "b"}])]
    with pytest.raises(UserError, match="would bring .* to 10200 elements.*allows 5000"):
        run_graph(*outer, limits=small, logprobs=torch.zeros(100))
    index = [node("call_function", "i", "torch.zeros_like", [X], {"dtype": {"dtype": "int64"}}),
             node("call_method", "j", "reshape", [{"ref": "i"}, -1, 1]),
             node("call_function", "k", "operator.getitem", [X, {"ref": "j"}])]  # [T] indexed by [T, 1]: T values
    loss, _ = run_graph(*index, node("call_method", "s", "sum", [{"ref": "k"}]), limits=small,
                        logprobs=torch.zeros(100))
    assert float(loss) == 0
    rows = [node("call_function", "i", "torch.zeros_like", [X], {"dtype": {"dtype": "int64"}}),
            node("call_method", "row", "unsqueeze", [X, 0]),
            node("call_function", "k", "operator.getitem", [{"ref": "row"}, {"ref": "i"}])]  # [1, T][T] → [T, T]
    with pytest.raises(UserError, match="to 10200 elements"):
        run_graph(*rows, limits=small, logprobs=torch.zeros(100))
    with pytest.raises(UserError, match="--custom-loss-max-elements"):  # each step fits; together they do not
        run_graph(*[node("call_function", f"e{i}", "torch.exp", [X]) for i in range(60)], limits=small,
                  logprobs=torch.zeros(100))


def test_python_values_cannot_grow_without_bound():
    shape = node("call_function", "shape", "getattr", [X, "shape"])
    doubling = [shape] + [node("call_function", f"d{i}", "operator.add", [{"ref": f"d{i - 1}" if i else "shape"}] * 2)
                          for i in range(20)]
    with pytest.raises(UserError, match="a sequence of more than 4096 items"):
        run_graph(*doubling)
    with pytest.raises(UserError, match="does not take tuples"):
        run_graph(shape, node("call_function", "m", "operator.mul", [{"ref": "shape"}, 10**9]))
    n = node("call_function", "n", "operator.getitem", [{"ref": "shape"}, 0])
    with pytest.raises(UserError, match="exponent may be at most 64"):
        run_graph(shape, n, node("call_function", "p", "operator.pow", [{"ref": "n"}, 10**12]))
    with pytest.raises(UserError, match="an integer beyond 64 bits"):
        run_graph(shape, n, node("call_function", "p", "operator.pow", [{"ref": "n"}, 60]))


def test_failures_while_running_are_user_errors_naming_the_node():
    with pytest.raises(UserError, match=r"node 'bad' \(torch.add\) failed: TypeError"):
        run_graph(node("call_function", "bad", "torch.add", [X, {"tuple": [1, 2]}]))
    with pytest.raises(UserError, match="must return a scalar floating-point loss, got \\(8,\\)"):
        run_graph(node("call_function", "e", "torch.exp", [X]))
    with pytest.raises(UserError, match="scalar floating-point loss"):
        run_graph(node("call_method", "s", "sum", [X]), node("call_method", "i", "long", [{"ref": "s"}]))
    nodes = [node("placeholder", "logprobs", "logprobs"), node("call_method", "s", "sum", [X]),
             node("output", "output", "output", [{"tuple": [{"ref": "s"}, {"dict": {"custom/v:sum": X}}]}])]
    with pytest.raises(UserError, match="metric 'custom/v:sum' must be a one-element tensor"):
        run_datum(compile_custom_loss("l", INPUTS, nodes, LIMITS), torch.zeros(4), {})


def test_the_allow_list_has_no_in_place_or_escaping_operations():
    assert not [m for m in ops.METHODS if m.endswith("_") or m.startswith("_")]
    assert not {"item", "tolist", "numpy", "backward", "register_hook", "data_ptr", "storage"} & ops.METHODS
    names = set(ops.FUNCTIONS)
    assert all(n.split(".")[0] in ("torch", "math", "operator", "getattr", "builtins") for n in names)
    assert {"getattr", "builtins.getattr"} <= names and not {"builtins.eval", "builtins.setattr"} & names


def test_datum_inputs_are_checked_at_their_declared_rank():
    _, loss = traced(dpo)
    good = {"target_tokens": np.zeros(4, np.int64), "chosen_mask": np.ones(4, np.float32),
            "rejected_mask": np.zeros(4, np.float32), "ref_logprobs": np.zeros(4, np.float32),
            "beta": np.array(0.1, np.float32), "unused": np.zeros(4, np.float32)}

    def check(inputs, n=4):
        check_custom_datum(loss, 0, np.zeros(n, np.int64), inputs, vocab_size=512, max_context=2048)

    check(good)
    with pytest.raises(UserError, match=r"no loss_fn_inputs\['beta'\]"):
        check({k: v for k, v in good.items() if k != "beta"})
    with pytest.raises(UserError, match="'beta'.*rank 1.*declared beta with rank 0"):
        check({**good, "beta": np.ones(4, np.float32)})
    with pytest.raises(UserError, match="declared logprobs with rank 1"):
        check({**good, "target_tokens": np.zeros((4, 2), np.int64)})
    with pytest.raises(UserError, match="target_tokens ids"):
        check({**good, "target_tokens": np.full(4, 600, np.int64)})
    one = {k: (v[:1] if v.ndim else v.reshape(1)) for k, v in good.items()}  # T = 1: [1] and [] look alike
    check(one, n=1)


def test_a_scalar_input_decodes_from_the_sdk_wire_form():
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={
        "target_tokens": np.array([2, 3, 4], np.int64),
        "beta": types.TensorData(data=[0.25], dtype="float32", shape=[]),
        "mask": np.ones(3, np.float32)})
    for loss_fn, expect in [("custom", ()), ("cross_entropy", None)]:
        request = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
            data=[datum], loss_fn=loss_fn, loss_fn_config={"loss_id": "x"} if loss_fn == "custom" else None),
            model_id="s:train:0", seq_id=1)
        body = forward_backward_request_to_proto(request).SerializeToString()
        if expect is None:  # built-in losses keep one row per position
            with pytest.raises(UserError, match="beta"):
                decode_forward_backward(body, DatumLimits(max_context=2048, max_columns=64, max_datums=32768))
            continue
        batch = decode_forward_backward(body, DatumLimits(max_context=2048, max_columns=64, max_datums=32768))
        assert batch.loss_fn_config == {"loss_id": "x"}
        assert batch.data[0].loss_fn_inputs["beta"].shape == expect
        assert float(batch.data[0].loss_fn_inputs["beta"]) == 0.25
        assert batch.data[0].loss_fn_inputs["mask"].shape == (3,)


def test_a_named_device_means_the_device_the_loss_runs_on():
    cuda = {"device": "cuda:0"}
    loss, _ = run_graph(node("call_function", "t", "torch.tensor", [[1.0, 2.0]], {"device": cuda}),
                        node("call_method", "m", "to", [X], {"device": cuda, "dtype": {"dtype": "float64"}}),
                        node("call_method", "s", "sum", [{"ref": "m"}]),
                        node("call_method", "u", "sum", [{"ref": "t"}]),
                        node("call_function", "a", "operator.add", [{"ref": "s"}, {"ref": "u"}]),
                        logprobs=torch.ones(4))
    assert float(loss) == 7.0 and loss.device.type == "cpu" and loss.dtype == torch.float64


def doubling(steps: int, start: str = "logprobs") -> list:
    """``t[i] = (t[i-1],) + (t[i-1],)``: each step makes a pair of the last value, 2**steps leaves in ``steps``
    values (issue 31, row 4)."""
    return [node("call_function", f"t{i}", "operator.add",
                 [{"tuple": [{"ref": f"t{i - 1}" if i else start}]}] * 2) for i in range(steps)]


@pytest.mark.timeout(60)
def test_a_value_shared_many_times_over_costs_what_it_is_not_what_it_would_be_written_out():
    with pytest.raises(UserError, match=r"nested deeper than 8 levels \(--custom-loss-max-nesting\)"):
        run_graph(*doubling(24))
    roomy = CustomLossLimits(max_nesting=64, max_elements=2**62)
    loss, _ = run_graph(*doubling(50), node("call_method", "s", "sum", [X]), limits=roomy)  # 2**50 leaves
    assert float(loss) == 0
    with pytest.raises(UserError, match=r"node 't22' .* would bring .* to 67108872 elements"):  # 2**23 copies of 8
        run_graph(*doubling(50), limits=CustomLossLimits(max_nesting=64))


def test_every_argument_counts_against_the_constants_limit_references_too():
    many = node("call_function", "c", "torch.stack", [{"tuple": [X] * 5000}])
    refused(graph(many), "more than 4096 constants (--custom-loss-max-constants)")
    assert LIMITS.encoded_bytes() < 8 << 20  # what a create_custom_loss body may be, before it is read


def test_an_index_of_python_values_is_sized_before_it_allocates():
    small = CustomLossLimits(max_elements=5000)
    row = node("call_method", "row", "unsqueeze", [X, 0])  # [1, 100]
    with pytest.raises(UserError, match="to 100100 elements.*allows 5000"):  # [[0] * 1000] makes [1000, 100]
        run_graph(row, node("call_function", "k", "operator.getitem", [{"ref": "row"}, [0] * 1000]), limits=small,
                  logprobs=torch.zeros(100))
    zeros = node("call_function", "zeros", "operator.add", [[0] * 32, [0] * 32])
    with pytest.raises(UserError, match="indexes with 8192 Python values; at most 4096"):  # 64 zeros, doubled 7 times
        run_graph(row, zeros, *doubling(7, start="zeros"),
                  node("call_function", "k", "operator.getitem", [{"ref": "row"}, {"ref": "t6"}]),
                  logprobs=torch.zeros(100))
    mask = [node("call_function", "m", "operator.gt", [X, 0.5]),
            node("call_function", "k", "operator.getitem", [X, {"ref": "m"}])]  # a mask selects at most T
    loss, _ = run_graph(*mask, node("call_method", "s", "sum", [{"ref": "k"}]), limits=CustomLossLimits(
        max_elements=450), logprobs=torch.ones(100))
    assert float(loss) == 100


def test_a_value_on_another_device_and_a_loss_past_its_time_are_user_errors():
    with pytest.raises(UserError, match="made a tensor on device meta"):
        run_graph(node("call_method", "m", "to", [X, "meta"]), node("call_method", "s", "sum", [{"ref": "m"}]))
    chain = [node("call_function", f"e{i}", "torch.exp", [X]) for i in range(5)]
    with pytest.raises(UserError, match=r"ran longer than 1e-09 s, forward and backward of all its datums together "
                                        r"\(at node 'e0'.*--custom-loss-max-seconds"):
        run_graph(*chain, limits=CustomLossLimits(max_seconds=1e-9))


def test_the_time_limit_is_the_whole_requests_forward_and_backward(monkeypatch):
    """--custom-loss-max-seconds bounds one request: its datums' steps and the loss's backward share one deadline
    (it bounded each datum's forward alone, so a request of many datums, and any backward, ran unbounded)."""
    import shims.custom_loss.run as run_module

    now = [100.0]
    monkeypatch.setattr(run_module.time, "monotonic", lambda: now[0])  # the one clock both read (device_time)
    loss = compile_custom_loss("l", INPUTS, graph(node("call_method", "s", "sum", [X])), CustomLossLimits(max_seconds=5))
    batch = CustomLossBatch(loss, torch.device("cpu"))
    logprobs = [torch.zeros(4, requires_grad=True) * 1.0 for _ in range(3)]
    totals = [batch.datum(logprobs[0], {})]
    now[0] += 4  # within the request's 5 s
    totals.append(batch.datum(logprobs[1], {}))
    now[0] += 2  # past it: the next datum fails, though it alone took no time
    with pytest.raises(UserError, match=r"ran longer than 5 s, forward and backward of all its datums together"):
        batch.datum(logprobs[2], {})
    with pytest.raises(UserError, match=r"at its backward; --custom-loss-max-seconds"):
        batch.gradients(torch.stack(totals).sum(), logprobs[:2])
    now[0] -= 2  # in time again: the backward runs, once, down to the logprobs
    grads = batch.gradients(torch.stack(totals).sum(), logprobs[:2])
    assert all(torch.equal(g, torch.ones(4)) for g in grads)


INDEXED_UNDER_A_MEMORY_CAP = """
import resource, sys
import torch
from types import SimpleNamespace
from tinker import types
from shims.custom_loss.graph import CustomLossLimits, compile_custom_loss
from shims.custom_loss.run import run_datum
from shims.errors import UserError

def node(op, name, target, args=(), kwargs=None):
    return SimpleNamespace(op=op, name=name, target=target, args=list(args), kwargs=kwargs or {})

X = {"ref": "logprobs"}
nodes = [node("placeholder", "logprobs", "logprobs"),
         node("call_method", "a", "unsqueeze", [X, 0]), node("call_method", "b", "unsqueeze", [X, 1]),
         node("call_function", "c", "operator.mul", [{"ref": "a"}, {"ref": "b"}]),  # [1000, 1000]
         node("call_method", "d", "unsqueeze", [{"ref": "c"}, 0]),  # [1, 1000, 1000]
         node("call_function", "k", "operator.getitem", [{"ref": "d"}, [0] * 1024]),  # [1024, 1000, 1000]: 4 GB
         node("call_method", "s", "sum", [{"ref": "k"}]),
         node("output", "output", "output", [{"tuple": [{"ref": "s"}, {"dict": {}}]}])]
loss = compile_custom_loss("l", [types.CustomLossInput(name="logprobs", rank=1)], nodes, CustomLossLimits())
size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))
try:
    run_datum(loss, torch.zeros(1000), {})
except UserError as exc:
    print(exc)
"""


def test_an_index_is_refused_before_its_result_takes_memory():
    """Row 7 as the trainer meets it: ``d[[0] * 1024]`` asks for 4 GB. Run under an address-space cap of 1 GiB more
    than the process holds, the refusal must come from the element budget, before the allocation could fail."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", INDEXED_UNDER_A_MEMORY_CAP], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "node 'k' (operator.getitem) would bring" in done.stdout, done.stdout
    assert "--custom-loss-max-elements" in done.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: on the CPU every step is done when it "
                                                           "returns, so host time is device time")
def test_the_custom_loss_clock_waits_for_the_gpu_work_it_launched():
    """Issue 44: the custom-loss deadline read the host clock, which on a GPU passes before queued kernels run, so a
    loss of slow kernels ran on past --custom-loss-max-seconds. ``device_time`` reads it once the device is done."""
    from shims.custom_loss.run import device_time

    device = torch.device("cuda")
    started = device_time(device)
    torch.cuda._sleep(2_000_000_000)  # a kernel that spins on the GPU for about a second
    launched = time.monotonic()
    assert launched - started < 0.2  # the launch returned at once
    assert device_time(device) - started > 0.3  # the clock waited for the kernel

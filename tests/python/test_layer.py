"""The example Engram layer (python/examples/engram_layer.py, on the package) against the independent reference
(spec_reference.py: docs/math.md alone, NumPy, float64 gate) on fresh random token streams: several requests, lookback
(some unknown), DEAD spans, every Engram layer. NumPy on the CPU backend; torch on CUDA where the GPU machine has it."""
import numpy as np
import pytest

import engram
import spec_reference as ref
from conftest import torch_cuda
from engram_layer import EngramLayer, EngramStep, bf16_bits_from_f32, random_batch


def compare(got_bits, want):
    got = ref.bf16_bits_to_f64(got_bits)
    # bf16 tolerance: kv rounded to bf16 after differently ordered sums can differ by one unit in the last place,
    # which moves the gate slightly; the output is rounded to bf16 once more.
    err = np.abs(got - want)
    tol = 2 ** -6 * np.abs(want) + 2 ** -6 * np.abs(want).mean()
    bad = err > tol
    assert not bad.any(), f"{bad.sum()} of {bad.size} values differ, worst {err.max()}"


def run_layer_case(table, checkpoint, reference, seed, to_device=None, from_device=None):
    rng = np.random.default_rng(seed)
    lens = [int(x) for x in rng.integers(1, 12, size=int(rng.integers(2, 5)))]
    T = sum(lens)
    tokens, positions, qsl, lookback, dead = random_batch(rng, len(reference.tmap), lens, reference.N, 0.15)
    hidden = bf16_bits_from_f32(rng.standard_normal((T, reference.hc, reference.hidden)).astype(np.float32))
    step = EngramStep(table, 64)
    layers = [EngramLayer(step, checkpoint, i) for i in range(len(reference.layer_ids))]
    conv = to_device or (lambda x: x)
    ids = step.begin(conv(tokens), conv(positions), conv(qsl), conv(lookback), conv(dead))
    for li, layer in enumerate(layers):
        h = conv(hidden, bf16=True) if to_device else hidden
        out = layer(h, ids, conv(dead))
        out_bits = from_device(out) if from_device else out
        want_ids, want = reference.layer(li, hidden, tokens, positions, qsl, lookback, dead)
        got_ids = from_device(ids, raw=True) if from_device else ids
        np.testing.assert_array_equal(got_ids, want_ids)
        compare(out_bits, want)
        assert (out_bits[dead.astype(bool)] == hidden[dead.astype(bool)]).all()  # DEAD tokens pass through


@pytest.mark.parametrize("seed", [101, 202, 303, 404])
def test_layer_on_the_cpu_backend_equals_the_reference(checkpoint, reference, tmp_path, seed):
    t = engram.attach(checkpoint, socket=str(tmp_path / "none.sock"), timeout_ms=300, backend="cpu")
    run_layer_case(t, checkpoint, reference, seed)


@pytest.mark.parametrize("seed", [505, 606])
def test_layer_on_cuda_equals_the_reference(checkpoint, reference, tmp_path, seed):
    torch = torch_cuda()
    if torch is None:
        pytest.skip("needs torch >= 2.4 with a CUDA GPU (the GPU machine runs it)")
    t = engram.attach(checkpoint, socket=str(tmp_path / "none.sock"), timeout_ms=300)
    assert t.backend == "cuda", t.reasons

    def to_device(x, bf16=False):
        if bf16:
            return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda()
        return torch.from_numpy(x).cuda()

    def from_device(x, raw=False):
        if raw:
            return x.cpu().numpy()
        return x.view(torch.int16).cpu().numpy().view(np.uint16)

    run_layer_case(t, checkpoint, reference, seed, to_device, from_device)

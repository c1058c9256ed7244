"""``steerable.ray.Generate`` / ``Capture`` on Ray Data (one local cluster for the module, CPU
actors): every row equals offline ``LLM.generate`` / ``steerable.capture`` with the same prompt,
sampling, steering and capture (greedy and seeded tokens identical, captures within 1e-5), the
output writes to Parquet as it is, bad rows fail naming the field, and Ray stays optional."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import CORPUS, PROMPTS

import steerable
from steerable import LLM, CaptureSpec, Clamp, SamplingParams, SteeringSpec
from steerable.errors import InvalidRequestError
from steerable.steering.wire import spec_to_dict

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # a Ray cluster and an engine per actor

ENGINE = {"device": "cpu", "kv_cache_tokens": 4096}
GREEDY = {"max_tokens": 4, "temperature": 0.0}
TEXTS = [f"{i}: {CORPUS[i % 7]}" for i in range(9)]
g = torch.Generator().manual_seed(0)
V, D, LOUD = (torch.randn(64, generator=g) for _ in range(3))


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def path(capture_dirs):
    return capture_dirs["llama"]


@pytest.fixture(scope="module")
def sae_dir(tmp_path_factory):
    from test_sae_registry import random_sae, save_saelens

    return save_saelens(random_sae(architecture="topk", layer=1), tmp_path_factory.mktemp("sae") / "res1")


@pytest.fixture(scope="module")
def offline(path, sae_dir):
    llm = LLM(path, **ENGINE)
    llm.register_steering_modules({"loud": {1: LOUD}})
    llm.register_sae("res1", steerable.SAE.load(sae_dir))
    return llm


def cases():
    """(row as JSON, the prompt and SamplingParams that mean the same offline)."""
    clamp = SteeringSpec([Clamp(1, D, hook="post_attn", min=0.0, max=0.0)])
    chat = [{"role": "user", "content": "Hello world"}]
    return [
        ({"request_id": "plain", "prompt": PROMPTS[0], "sampling_params": {"max_tokens": 5}},
         PROMPTS[0], SamplingParams(max_tokens=5, temperature=0.0)),
        ({"request_id": "ids", "prompt_token_ids": [1, 40, 41, 42, 43], "steering": {"1": (4 * V).tolist()},
          "capture": {"layers": [2], "select": "all"}},
         [1, 40, 41, 42, 43], SamplingParams(**GREEDY, steering_vectors={1: 4 * V},
                                             capture=CaptureSpec(layers=[2], select="all"))),
        ({"request_id": "chat", "messages": chat,
          "steering": {"post_attn": {"0": {"vector": V.tolist(), "scale": 2.0}}},
          "capture": {"layers": [0, 2], "select": "all"}},
         chat, SamplingParams(**GREEDY, steering_vectors={"post_attn": {0: {"vector": V, "scale": 2.0}}},
                              capture=CaptureSpec(layers=[0, 2], select="all"))),
        ({"request_id": "clamp", "prompt": PROMPTS[1], "steering": spec_to_dict(clamp),
          "capture": {"layers": [1], "hook": "post_attn", "select": "all"}},
         PROMPTS[1], SamplingParams(**GREEDY, steering_vectors=clamp,
                                    capture=CaptureSpec(layers=[1], hook="post_attn", select="all"))),
        ({"request_id": "module", "prompt": PROMPTS[3], "steering_module_ref": {"name": "loud", "scale": 0.5},
          "capture": {"layers": [2], "select": "last_prompt"}},
         PROMPTS[3], SamplingParams(**GREEDY, steering_module_ref=("loud", 0.5),
                                    capture=CaptureSpec(layers=[2], select="last_prompt"))),
        ({"request_id": "sampled", "prompt": PROMPTS[5], "sampling_params": {"max_tokens": 6, "temperature": 0.8,
                                                                             "seed": 7}},
         PROMPTS[5], SamplingParams(max_tokens=6, temperature=0.8, seed=7)),
    ]


def reference(llm, prompt, params):
    return (llm.chat(prompt, params, use_tqdm=False) if isinstance(prompt, list) and isinstance(prompt[0], dict)
            else llm.generate([prompt], params, use_tqdm=False))[0]


def assert_row_equals(row, ref):
    assert list(row["token_ids"]) == list(ref.outputs[0].token_ids)
    assert row["generated_text"] == ref.outputs[0].text and row["finish_reason"] == ref.outputs[0].finish_reason
    assert list(row["prompt_token_ids"]) == list(ref.prompt_token_ids)
    for stream, layers in ref.captures.items():
        for layer, tensor in layers.items():
            base = f"{stream}.{layer}"
            got = torch.from_numpy(np.asarray(row[base]))
            assert got.shape == tensor.shape and torch.allclose(got, tensor, atol=1e-5, rtol=0), base
            meta = ref.capture_meta[stream][layer]
            assert list(row[f"{base}.positions"]) == meta.positions.tolist()
            assert list(row[f"{base}.token_ids"]) == meta.token_ids.tolist()


def test_generate_rows_equal_offline(cluster, path, offline, tmp_path):
    from steerable.ray import Generate

    rows = cases()
    with open(tmp_path / "prompts.jsonl", "w") as f:
        for row, _, _ in rows:
            f.write(json.dumps(row) + "\n")
    ds = ray.data.read_json(str(tmp_path / "prompts.jsonl"))
    out = ds.map_batches(Generate, fn_constructor_kwargs={"model": path, "engine_kwargs": ENGINE,
                                                          "sampling_params": GREEDY,
                                                          "steering_modules": {"loud": {"1": LOUD.tolist()}}},
                         concurrency=2, num_cpus=0.5, batch_size=2).materialize()  # a CPU left for the reads
    got = {row["request_id"]: row for row in out.take_all()}
    assert sorted(got) == sorted(row["request_id"] for row, _, _ in rows)
    assert "steering" not in got["ids"] and got["plain"]["prompt"] == PROMPTS[0]  # request fields consumed, the rest kept
    for row, prompt, params in rows:
        ref = reference(offline, prompt, params)
        assert_row_equals(got[row["request_id"]], ref)
    # Steering took effect: the same prompts unsteered capture something else.
    for rid, prompt, spec in [("chat", rows[2][1], rows[2][2].capture), ("clamp", PROMPTS[1], rows[3][2].capture),
                              ("ids", rows[1][1], rows[1][2].capture)]:
        plain = reference(offline, prompt, SamplingParams(**GREEDY, capture=spec))
        (layer, tensor), = list(plain.captures["hidden_states"].items())[-1:]
        steered = torch.from_numpy(np.asarray(got[rid][f"hidden_states.{layer}"]))
        assert (steered - tensor).abs().max() > 1e-2, rid
    # Ragged captures and token lists are plain tensor columns: the output writes to Parquet as it is.
    out.write_parquet(str(tmp_path / "out"))
    back = {row["request_id"]: row for row in ray.data.read_parquet(str(tmp_path / "out")).take_all()}
    assert np.array_equal(back["chat"]["hidden_states.0"], got["chat"]["hidden_states.0"])
    assert len(back["plain"]["hidden_states.2"]) == 0  # a row without that capture: zero rows


def test_capture_rows_equal_steerable_capture(cluster, path, offline):
    from steerable.ray import Capture

    ds = ray.data.from_items([{"id": i, "text": text} for i, text in enumerate(TEXTS)])
    out = ds.map_batches(Capture, fn_constructor_kwargs={"model": path, "layers": [0, 2], "select": "all",
                                                         "engine_kwargs": ENGINE},
                         concurrency=1, num_cpus=0.5, batch_size=4).materialize()
    ref = steerable.capture(offline, TEXTS, layers=[0, 2], select="all")
    rows = out.take_all()
    assert len(rows) == len(ref.meta(0)) and set(rows[0]) == {"id", "position", "token_id", "layer.0", "layer.2"}
    for i in range(len(TEXTS)):
        mine = sorted((r for r in rows if r["id"] == i), key=lambda r: r["position"])
        meta = ref.outputs[i].capture_meta["hidden_states"][0]
        assert [r["position"] for r in mine] == meta.positions.tolist()
        assert [r["token_id"] for r in mine] == meta.token_ids.tolist()
        for layer in (0, 2):
            got = torch.from_numpy(np.stack([r[f"layer.{layer}"] for r in mine]))
            assert torch.allclose(got, ref.sample(i)[layer], atol=1e-5, rtol=0)
    batch = next(iter(out.iter_torch_batches(batch_size=16, dtypes=torch.float32)))  # activation batches for a trainer
    assert batch["layer.2"].shape == (16, 64)


@pytest.fixture(scope="module")
def local_generate(path, sae_dir):
    """The transform called in this process (no Ray): row parsing, SAE features and errors."""
    from steerable.ray import Generate

    return Generate(path, engine_kwargs=ENGINE, sampling_params=GREEDY, saes={"res1": sae_dir})


def test_sae_features_and_feature_steering(local_generate, offline, path, sae_dir):
    from steerable import Feature
    from steerable.ray import Capture

    capture = {"stream": "sae_features", "saes": ["res1"], "top_k": 4, "select": "all"}
    steering = {"features": [{"sae": "res1", "index": 5, "scale": 3.0}]}
    out = local_generate({"prompt": np.array([PROMPTS[1]], dtype=object),
                          "capture": np.array([capture], dtype=object), "steering": np.array([steering], dtype=object)})
    ref = reference(offline, PROMPTS[1], SamplingParams(**GREEDY, steering_vectors=SteeringSpec(features=[
        Feature("res1", 5, scale=3.0)]), capture=CaptureSpec(stream="sae_features", saes=["res1"], top_k=4,
                                                              select="all")))
    features = ref.captures["sae_features"]["res1"]
    assert list(out["token_ids"][0]) == list(ref.outputs[0].token_ids)
    assert np.array_equal(out["sae_features.res1.indices"][0], features.indices.numpy())
    assert np.allclose(out["sae_features.res1.values"][0], features.values.numpy(), atol=1e-5)
    assert list(out["sae_features.res1.positions"][0]) == ref.capture_meta["sae_features"]["res1"].positions.tolist()
    # Capture with an SAE: one row per token with its top-k features, as sparse corpus shards hold them.
    rows = Capture(path, sae="res1", saes={"res1": sae_dir}, top_k=4, select="all_prompt", engine_kwargs=ENGINE)(
        {"text": np.array(TEXTS[:3], dtype=object), "id": np.arange(3)})
    want = steerable.capture(offline, TEXTS[:3], stream="sae_features", saes=["res1"], top_k=4, select="all_prompt")
    assert set(rows) == {"id", "position", "token_id", "indices", "values"}
    assert np.array_equal(rows["indices"], want.rows("res1").indices.numpy())
    assert np.allclose(rows["values"], want.rows("res1").values.numpy(), atol=1e-5)
    assert rows["id"].tolist() == [i for i, out in enumerate(want.outputs)
                                   for _ in range(len(out.capture_meta["sae_features"]["res1"]))]


def test_batches_in_every_format_and_json_cells(local_generate, offline):
    import pandas as pd

    capture = {"layers": [1], "select": {"prompt_positions": [0, -1]}}
    rows = [{"prompt": PROMPTS[2], "capture": json.dumps(capture), "sampling_params": json.dumps({"max_tokens": 3})},
            {"prompt": PROMPTS[4], "capture": json.dumps({"layers": [1], "select": "all"}),
             "sampling_params": json.dumps({"max_tokens": 2})}]
    refs = [reference(offline, PROMPTS[2], SamplingParams(max_tokens=3, temperature=0.0,
                                                          capture=CaptureSpec(layers=[1], select=capture["select"]))),
            reference(offline, PROMPTS[4], SamplingParams(max_tokens=2, temperature=0.0,
                                                          capture=CaptureSpec(layers=[1], select="all")))]
    numpy_batch = {key: np.array([row[key] for row in rows], dtype=object) for key in rows[0]}
    for batch in (numpy_batch, pd.DataFrame(rows)):
        out = local_generate(batch)
        for i, ref in enumerate(refs):
            assert_row_equals({key: column[i] for key, column in out.items()}, ref)
    # Arrow's forms: a nullable integer as a float, lists as arrays, a struct's absent keys as None.
    out = local_generate({"prompt": np.array([PROMPTS[2]], dtype=object),
                          "sampling_params": np.array([{"max_tokens": 3.0, "seed": None}], dtype=object),
                          "capture": np.array([{"layers": np.array([1.0]), "select": {"prompt_positions": np.array(
                              [0.0, -1.0]), "generation": None}, "hook": None}], dtype=object)})
    assert_row_equals({key: column[0] for key, column in out.items()}, refs[0])


@pytest.mark.parametrize("row, field", [
    ({"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "give one of"),
    ({"sampling_params": {"max_tokens": 2}}, "give one of"),
    ({"prompt": "a", "sampling_params": {"n": 2}}, "sampling_params.n"),
    ({"prompt": "a", "sampling_params": {"max_tokenz": 2}}, "sampling_params"),
    ({"prompt": "a", "sampling_params": {"capture": {"layers": [1]}}}, "sampling_params.capture"),
    ({"prompt": "a", "capture": {"layers": [1], "selct": "all"}}, "capture.selct"),
    ({"prompt": "a", "capture": "{not json"}, "capture: not valid JSON"),
    ({"prompt": "a", "steering": {"interventions": [{"type": "add", "layer": 1, "vectr": [0.0]}]}}, "vectr"),
    ({"prompt": "a", "steering": {"1": [0.5] * 63}}, "steering"),  # wrong width: refused at admission
    ({"prompt_token_ids": ["x"]}, "prompt_token_ids"),
])
def test_bad_rows_name_the_field(local_generate, row, field):
    batch = {key: np.array([value], dtype=object) for key, value in row.items()}
    with pytest.raises(InvalidRequestError, match=field):
        local_generate(batch)
    engine = local_generate.llm.llm_engine
    assert not engine.has_unfinished_requests()  # nothing half-run stays behind
    ok = local_generate({"prompt": np.array(["Hello"], dtype=object)})
    assert len(ok["token_ids"][0]) == GREEDY["max_tokens"]


def test_duplicate_request_ids_refused(local_generate):
    with pytest.raises(InvalidRequestError, match="request_id"):
        local_generate({"prompt": np.array(["a", "b"], dtype=object), "request_id": np.array(["x", "x"], dtype=object)})


def run_python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)


def test_ray_stays_optional():
    done = run_python("import sys, steerable; steerable.LLM; steerable.ActivationStream; import steerable.capture; "
                      "assert 'ray' not in sys.modules, 'import steerable imported ray'")
    assert done.returncode == 0, done.stderr
    # Without Ray: an ImportError saying what to install, which a caller of corpus capture's
    # ``ray=`` also catches as the ValueError naming ``ray``.
    done = run_python("import sys; sys.modules['ray'] = None\n"
                      "try:\n    import steerable.ray\nexcept ImportError as e:\n"
                      "    assert isinstance(e, ValueError) and str(e).startswith('ray: ')\n    print(e)\n")
    assert done.returncode == 0 and "pip install 'steerable[ray]'" in done.stdout, done.stderr

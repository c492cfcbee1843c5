"""The deployment files (deploy/): every hybrid-jax container's arguments parse with the CLI's own parser
(and warm-up and serve agree on the engine flags, so the replicas read the Job's programs), every probe
asks a path the server answers, ports and volumes line up, the router's arguments parse and validate with
sglang-router's own parser, and the Dockerfile serves on the port the manifests probe."""
from __future__ import annotations

import pathlib
import re

import pytest
import yaml

from hybrid_jax.cli_args import build_parser
from hybrid_jax.cli_config import _engine_config
from hybrid_jax.server.app import ServerConfig, ServerState, build_app

DEPLOY = pathlib.Path(__file__).parents[2] / "deploy"


def _docs():
    out = []
    for f in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        out += [(f.name, d) for d in yaml.safe_load_all(f.read_text()) if d]
    return out


def _pod_specs():
    for name, d in _docs():
        if d["kind"] == "Deployment":
            yield name, d, d["spec"]["template"]["spec"]
        elif d["kind"] == "Job":
            yield name, d, d["spec"]["template"]["spec"]


def _containers(image_prefix: str):
    return [(name, spec, c) for name, d, spec in _pod_specs() for c in spec["containers"]
            if c["image"].startswith(image_prefix + ":")]


def test_every_document_is_a_known_kind_with_a_name():
    kinds = [d["kind"] for _, d in _docs()]
    assert {"Deployment", "Service", "Job", "ServiceAccount", "Role", "RoleBinding"} == set(kinds)
    for _, d in _docs():
        assert d["apiVersion"] and d["metadata"]["name"]


def test_server_args_parse_and_warmup_builds_the_programs_serve_runs():
    ap = build_parser()
    parsed = {}
    for name, _, c in _containers("hybrid-jax"):
        args = ap.parse_args(c["args"])          # argparse exits (SystemExit) on an unknown flag
        parsed[args.command] = args
    assert set(parsed) == {"serve", "warmup"}
    serve, warm = parsed["serve"], parsed["warmup"]
    assert serve.host == "0.0.0.0" and serve.compilation_cache_dir == warm.compilation_cache_dir
    # the program store's key holds the pool shapes and the model: the same engine config but the disk tier
    ignore = {"kv_cache_dir"}
    e_serve, e_warm = _engine_config(serve).__dict__, _engine_config(warm).__dict__
    assert {k: v for k, v in e_serve.items() if k not in ignore} == {k: v for k, v in e_warm.items()
                                                                       if k not in ignore}


def test_probes_ask_paths_the_server_answers_on_its_port():
    paths = {r.path for r in build_app(ServerState(ServerConfig())).routes}
    for name, spec, c in _containers("hybrid-jax"):
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        if c["args"][0] == "serve":
            port = int(c["args"][c["args"].index("--port") + 1])
            assert ports == {"http": port}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            if probe in c:
                get = c[probe]["httpGet"]
                assert get["path"] in paths and get["port"] in ports, (name, probe)
        assert c.get("livenessProbe", {}).get("httpGet", {}).get("path") in (None, "/liveness")


def test_volume_mounts_name_volumes_of_their_pod_and_the_env_they_expand():
    for name, spec, c in [(n, s, c) for n, _, s in _pod_specs() for c in s["containers"]]:
        vols = {v["name"] for v in spec.get("volumes", [])}
        env = {e["name"] for e in c.get("env", [])}
        for m in c.get("volumeMounts", []):
            assert m["name"] in vols, (name, m)
            for var in re.findall(r"\$\((\w+)\)", m.get("subPathExpr", "")):
                assert var in env, (name, var)


def _serve_args(d) -> list[str]:
    (c,) = [c for c in d["spec"]["template"]["spec"]["containers"] if c["args"][0] == "serve"]
    return c["args"]


def test_router_args_parse_and_select_the_worker_pods():
    """Each file's router selects that file's serving pods: by one selector, or (prefill/decode mode) its
    prefill selector the pods serving with --disaggregation-mode prefill and its decode selector the
    decode ones, which share one disk-tier volume (the handoffs go through it)."""
    launch = pytest.importorskip("sglang_router.launch_router")
    ap = build_parser()
    files = sorted({f for f, _ in _docs()})
    routers = 0
    for f in files:
        docs = [d for g, d in _docs() if g == f]
        deploys = [d for d in docs if d["kind"] == "Deployment"]
        for d in deploys:
            for router in [c for c in d["spec"]["template"]["spec"]["containers"] if c["name"] == "router"]:
                routers += 1
                ra = launch.parse_router_args(router["args"])
                ra._validate_router_args()
                assert ra.health_check_endpoint == "/readiness"
                servers = [x for x in deploys if any(c["args"][0] == "serve"
                                                     for c in x["spec"]["template"]["spec"]["containers"])]
                def labels(x):
                    return x["spec"]["template"]["metadata"]["labels"]
                if not ra.pd_disaggregation:
                    (w,) = servers
                    assert ra.service_discovery and ra.selector and ra.selector.items() <= labels(w).items()
                    targets = [w]
                else:
                    by_mode = {ap.parse_args(_serve_args(x)).disaggregation_mode: x for x in servers}
                    assert set(by_mode) == {"prefill", "decode"}
                    assert ra.prefill_selector.items() <= labels(by_mode["prefill"]).items()
                    assert ra.decode_selector.items() <= labels(by_mode["decode"]).items()
                    assert not ra.decode_selector.items() <= labels(by_mode["prefill"]).items()
                    args = {m: ap.parse_args(_serve_args(x)) for m, x in by_mode.items()}
                    assert all(a.enable_prefix_caching and a.kv_cache_dir for a in args.values())
                    claims = []
                    for m, x in by_mode.items():
                        spec = x["spec"]["template"]["spec"]
                        (c,) = spec["containers"]
                        (mount,) = [v for v in c["volumeMounts"] if v["mountPath"] == args[m].kv_cache_dir]
                        assert "subPathExpr" not in mount          # one directory for every pod
                        (vol,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
                        claims.append(vol["persistentVolumeClaim"]["claimName"])
                    assert claims[0] == claims[1]
                    annotations = by_mode["prefill"]["spec"]["template"]["metadata"].get("annotations", {})
                    assert int(annotations["sglang.ai/bootstrap-port"]) == args["prefill"].disaggregation_bootstrap_port
                    targets = servers
                for w in targets:
                    assert ra.service_discovery_port == int(_serve_args(w)[_serve_args(w).index("--port") + 1])
    assert routers == len(files) - 1          # every file but the warm-up Job's has its router


def test_the_image_serves_on_the_port_the_manifests_probe():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^EXPOSE 8000$", text, re.M) and '"--port", "8000"' in text
    assert re.search(r'^ENTRYPOINT \["hybrid-jax"\]$', text, re.M)
    for d in ("hybrid_jax", "cache", "pallas_kernels"):           # the packages pyproject installs
        assert f"COPY {d} ./{d}" in text

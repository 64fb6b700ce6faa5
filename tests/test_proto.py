"""The generated gRPC code matches proto/agent.proto."""

from conftest import ROOT, requires


@requires("grpc_tools", "grpcio-tools==1.85.1 (pinned in the dev extra)")
def test_generated_code_is_fresh(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("generate", ROOT / "proto" / "generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    stale = []
    for path in gen.generate(tmp_path):
        committed = ROOT / "proto" / path.name
        if not committed.exists() or committed.read_text() != path.read_text():
            stale.append(path.name)
    assert not stale, f"{stale} are stale: run 'python proto/generate.py' and commit the result"

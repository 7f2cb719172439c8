"""The persistent kernel cache: keys, atomic entries, corrupt or foreign files, unsafe places."""
import os
import stat
import subprocess
import sys

import pytest

from fuser import disk_cache
from fuser.ts_ir import lower

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("FUSER_CACHE_DIR", str(d))
    monkeypatch.delenv("FUSER_DISABLE_CACHE", raising=False)
    return d


def test_key_depends_on_every_field():
    base = [("nvrtc", "13.0"), ("arch", "90"), ("source", "x")]
    k = disk_cache.key(base)
    assert k == disk_cache.key(list(base))
    for i in range(len(base)):
        changed = list(base)
        changed[i] = (base[i][0], base[i][1] + "!")
        assert disk_cache.key(changed) != k
    # labels are part of the key, and fields cannot run into each other
    assert disk_cache.key([("a", "bc")]) != disk_cache.key([("ab", "c")])
    assert len(disk_cache.codegen_hash()) == 64


def test_directory_is_private(cache_dir):
    d = disk_cache.directory()
    assert d == cache_dir
    assert stat.S_IMODE(os.stat(d).st_mode) & 0o077 == 0


def test_unsafe_or_disabled_directory_turns_the_cache_off(cache_dir, monkeypatch):
    cache_dir.mkdir(mode=0o777)
    os.chmod(cache_dir, 0o777)
    assert disk_cache.directory() is None
    os.chmod(cache_dir, 0o700)
    assert disk_cache.directory() == cache_dir
    monkeypatch.setenv("FUSER_DISABLE_CACHE", "1")
    assert disk_cache.directory() is None


def test_roundtrip_and_second_lookup_does_not_build(cache_dir):
    calls = []

    def build():
        calls.append(1)
        return b"\x7fELF payload \x00\x01"

    fields = [("source", "kernel text")]
    before = disk_cache.hits
    assert disk_cache.get_or_build(fields, build, ".cubin") == b"\x7fELF payload \x00\x01"
    assert disk_cache.get_or_build(fields, build, ".cubin") == b"\x7fELF payload \x00\x01"
    assert len(calls) == 1
    assert disk_cache.hits == before + 1
    assert not [p for p in cache_dir.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign", "empty"])
def test_damaged_entries_are_misses_and_get_rewritten(cache_dir, damage):
    fields = [("source", f"damage {damage}")]
    disk_cache.get_or_build(fields, lambda: b"A" * 100, ".cubin")
    (path,) = [p for p in cache_dir.iterdir() if p.suffix == ".cubin"]
    data = path.read_bytes()
    path.write_bytes({"truncate": data[:-10], "flip": data[:-1] + b"B", "foreign": b"\x7fELF" + data[4:],
                      "empty": b""}[damage])
    assert disk_cache.read(path) is None
    calls = []
    out = disk_cache.get_or_build(fields, lambda: calls.append(1) or b"C" * 50, ".cubin")
    assert out == b"C" * 50 and calls == [1]
    assert disk_cache.read(path) == b"C" * 50


def test_a_second_process_takes_nvrtc_output_from_disk(cache_dir):
    """Two processes compile the same generated kernel: the second finds it on disk, NVRTC never runs."""
    code = (
        "import torch\n"
        "from fuser import codegen, compiler, disk_cache\n"
        "from fuser.cuda import driver\n"
        "from fuser.descs import ArgSpec, TensorDesc\n"
        "from fuser.kernel_cache import STORE\n"
        "from fuser.ts_ir import lower\n"
        "g = torch.parse_ir('graph(%x : Tensor):\\n  %a : Tensor = aten::sigmoid(%x)\\n"
        "  %b : Tensor = aten::neg(%a)\\n  return (%b)\\n')\n"
        "spec = STORE.get(STORE.register(lower(g)))\n"
        "a = ArgSpec('cuda', 0, (TensorDesc(torch.float16, 'dense'),), True)\n"
        "src = codegen.generate(spec.group, a.inputs, compiler.infer_types(spec, a, 'cpu'), 'cuda', 'k')\n"
        "opts = driver.NvrtcOptions(90)\n"
        "runs = []\n"
        "img = disk_cache.get_or_build([('source', src), ('flags', b' '.join(opts.flags()))],\n"
        "                              lambda: runs.append(1) or driver.compile_source(src, 'k', opts), '.cubin')\n"
        "print(len(runs), disk_cache.hits, len(img))\n")
    env = dict(os.environ, FUSER_CACHE_DIR=str(cache_dir))
    outs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout.split())
    assert outs[0][:2] == ["1", "0"]
    assert outs[1][:2] == ["0", "1"]
    assert outs[0][2] == outs[1][2]

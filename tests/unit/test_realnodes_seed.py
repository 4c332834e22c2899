"""A node's containerd root made from the seeded one (``hack/realnodes.link_root``): image files shared by hard
link, the bolt databases containerd rewrites in place copied, so a node never changes the seed."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "hack"))
import realnodes


def test_node_root_links_layers_and_copies_databases(tmp_path: Path) -> None:
    seed = tmp_path / "seed" / "root"
    layer = seed / "io.containerd.snapshotter.v1.overlayfs" / "snapshots" / "1" / "fs" / "usr" / "bin"
    layer.mkdir(parents=True)
    (layer / "python3").write_bytes(b"\x7fELF...")
    (seed / "io.containerd.metadata.v1.bolt").mkdir()
    (seed / "io.containerd.metadata.v1.bolt" / "meta.db").write_bytes(b"seed-meta")
    (seed / "io.containerd.snapshotter.v1.overlayfs" / "metadata.db").write_bytes(b"seed-snapshots")

    node = tmp_path / "node-0" / "containerd" / "root"
    realnodes.link_root(seed, node)

    binary = node / layer.relative_to(seed) / "python3"
    assert binary.read_bytes() == b"\x7fELF..."
    assert binary.stat().st_ino == (layer / "python3").stat().st_ino  # shared, not copied
    for db in ("io.containerd.metadata.v1.bolt/meta.db", "io.containerd.snapshotter.v1.overlayfs/metadata.db"):
        assert (node / db).stat().st_ino != (seed / db).stat().st_ino, db
    # the node's containerd writes its databases: the seed keeps its own
    (node / "io.containerd.metadata.v1.bolt" / "meta.db").write_bytes(b"node-meta")
    assert (seed / "io.containerd.metadata.v1.bolt" / "meta.db").read_bytes() == b"seed-meta"

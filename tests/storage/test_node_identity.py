"""A host's identity in its data directory (meta.properties): made once, kept, and owned by one cluster."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from logbus.errors import InconsistentClusterIdError, NodeIdentityError
from logbus.storage import node_identity
from logbus.storage.node_identity import META_FILE, NodeMeta, adopt, is_node_id, load_or_create, new_node_id, parse, read


def test_the_first_start_writes_a_node_id_that_every_later_start_reads_back(tmp_path):
    directory = str(tmp_path / "host")
    meta, created = load_or_create(directory)
    assert created and is_node_id(meta.node_id) and meta.cluster_id is None
    again, created_again = load_or_create(directory)
    assert again == meta and not created_again
    text = (tmp_path / "host" / META_FILE).read_text()
    assert f"node.id={meta.node_id}\n" in text and "version=1\n" in text and "cluster.id" not in text


def test_a_cluster_records_its_id_on_first_use_and_another_cluster_is_refused_naming_both(tmp_path):
    directory = str(tmp_path)
    meta, _ = load_or_create(directory)
    adopted = adopt(directory, meta.node_id, "cluster-a")
    assert adopted == NodeMeta(meta.node_id, "cluster-a") == read(directory)
    assert adopt(directory, meta.node_id, "cluster-a") == adopted  # the same cluster again: nothing changes
    before = (tmp_path / META_FILE).read_bytes()
    with pytest.raises(InconsistentClusterIdError) as refused:
        adopt(directory, meta.node_id, "cluster-b")
    assert "cluster-a" in str(refused.value) and "cluster-b" in str(refused.value) and directory in str(refused.value)
    assert (tmp_path / META_FILE).read_bytes() == before  # a refusal writes nothing
    # A later start of the host reads the cluster it belongs to.
    assert load_or_create(directory) == (adopted, False)


def test_a_directory_without_the_identity_the_host_advertises_is_refused(tmp_path):
    with pytest.raises(NodeIdentityError, match="missing"):
        adopt(str(tmp_path), new_node_id(), "cluster-a")
    meta, _ = load_or_create(str(tmp_path))
    other = new_node_id()
    with pytest.raises(NodeIdentityError, match=f"names node {meta.node_id}, but the host advertises node {other}"):
        adopt(str(tmp_path), other, "cluster-a")
    assert read(str(tmp_path)).cluster_id is None


@pytest.mark.parametrize("text, message", [
    ("version=1\n", "node.id None"),
    ("version=2\nnode.id=node-0123456789abcdef\n", "version '2'"),
    ("version=1\nnode.id=node-0123\n", "not a logbus node id"),
    ("version=1\nnode.id=node-0123456789abcdef\ngarbage\n", "line 3 is not key=value"),
])
def test_a_damaged_file_is_reported_never_replaced(tmp_path, text, message):
    (tmp_path / META_FILE).write_text(text)
    with pytest.raises(NodeIdentityError, match=message):
        load_or_create(str(tmp_path))
    assert (tmp_path / META_FILE).read_text() == text


def test_a_file_too_large_or_not_text_is_not_ours(tmp_path):
    (tmp_path / META_FILE).write_bytes(b"\xff\xfe" * 10)
    with pytest.raises(NodeIdentityError, match="not text"):
        read(str(tmp_path))
    (tmp_path / META_FILE).write_bytes(b"#" * (node_identity.META_BYTES_MAX + 1))
    with pytest.raises(NodeIdentityError, match="larger than"):
        read(str(tmp_path))


def test_node_ids_are_label_values_and_never_ray_node_ids():
    ids = {new_node_id() for _ in range(1000)}
    assert len(ids) == 1000
    for node_id in ids:
        assert is_node_id(node_id) and len(node_id) <= 63 and node_id[0].isalnum() and node_id[-1].isalnum()
    ray_node_id = "77b5e1b62b6ed7717948bf9c25f32ba2f482a779d59755323a823833"
    assert not is_node_id(ray_node_id) and not is_node_id("n1") and not is_node_id(None)


@settings(max_examples=200, deadline=None)
@given(cluster_id=st.none() | st.text(alphabet="0123456789abcdef", min_size=1, max_size=32))
def test_the_file_round_trips(cluster_id):
    meta = NodeMeta(new_node_id(), cluster_id)
    assert parse(meta.to_text(), "test") == meta


def test_written_atomically_no_temporary_file_left(tmp_path):
    meta, _ = load_or_create(str(tmp_path))
    adopt(str(tmp_path), meta.node_id, "c")
    assert sorted(os.listdir(tmp_path)) == [META_FILE]

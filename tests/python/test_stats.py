"""The daemon's stats reach Python as dicts of the proto messages (StatsReply,
ClientUsage in proto/actstash/v1/stash.proto): every field of the message under its
proto name, 64-bit counters as ints, and they count what the step did."""
import os
import re

import torch

from conftest import ROOT


def _proto_fields(message):
    with open(os.path.join(ROOT, "proto", "actstash", "v1", "stash.proto")) as f:
        text = f.read()
    body = re.search(r"^message %s \{(.*?)^\}" % message, text, re.S | re.M).group(1)
    field = re.compile(r"^\s*(?:repeated\s+)?[\w.]+\s+(\w+)\s*=\s*\d+;", re.M)
    return {m.group(1) for m in field.finditer(body)}


def test_stats_and_usage_are_the_proto_messages(stash):
    client = stash.client
    x = torch.randn(512, 512, requires_grad=True)
    with stash.offload(min_bytes=0):
        loss = (x * 2).sin().sum()
    daemon = client.stats(all_sessions=True)
    usage = client.zero_copy_usage()

    assert set(daemon) == _proto_fields("StatsReply")
    assert set(daemon["pool"]) == _proto_fields("PoolStats")
    assert set(daemon["self"]) == _proto_fields("SessionStats")
    assert set(daemon["self"]["client"]) == _proto_fields("ClientUsage")
    assert set(usage) == _proto_fields("ClientUsage")
    assert daemon["spill"] is None, "the test daemon has no spill tier"
    assert daemon["self"]["spill"] is None
    assert isinstance(daemon["pool"]["total_bytes"], int) and daemon["pool"]["total_bytes"] > 0
    assert daemon["self"]["session_id"] in [s["session_id"] for s in daemon["all_sessions"]]

    if client.attached:
        # The offloaded activations are in this client's leases: it counts them, and the
        # daemon shows its report (sent by stats()) as is.
        assert usage["objects"] > 0 and usage["bytes"] >= 512 * 512 * 4
        assert daemon["self"]["client"]["objects"] == usage["objects"]
        assert daemon["self"]["client"]["bytes_stored"] == usage["bytes_stored"]
        assert daemon["self"]["leased_bytes"] >= usage["bytes"]
    else:
        assert daemon["self"]["objects"] > 0, "the inline path stored them in the daemon"
    loss.backward()
    plain = x.detach().clone().requires_grad_()
    (plain * 2).sin().sum().backward()
    assert torch.equal(x.grad, plain.grad)

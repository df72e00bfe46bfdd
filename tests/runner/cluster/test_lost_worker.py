"""The paragraph that names a lost worker, from TensorFlow's error text and TF_CONFIG (no
cluster needed: the texts are the ones TensorFlow 2.21 gave on the two-node SLURM cluster)."""

import json

from gacli.runner.cluster.lost_worker import lost_tasks, lost_worker_error

CLUSTER = {"worker": ["gacli-node1:20448", "gacli-node2:20448", "gacli-node3:20448"]}
RESET = (
    "Collective ops is aborted by: recvmsg:Connection reset by peer\nAdditional GRPC error "
    "information from remote target /job:worker/replica:0/task:1 while calling RecvBuf"
)
SILENT = (
    "{{function_node __wrapped__CollectiveReduceV2_device_/job:worker/replica:0/task:0/device:CPU:0"
    "}} Collective ops is aborted by: Error reported from /job:worker/task:2: The following tasks"
    " are unhealthy (stopped sending heartbeats):\n/job:worker/replica:0/task:2"
)


def config(index, cluster=CLUSTER):
    return {"cluster": cluster, "task": {"type": "worker", "index": index}}


def test_the_lost_task_is_the_one_named_other_than_this_one():
    assert lost_tasks(RESET, config(0)) == [("worker", 1, "gacli-node2:20448")]
    assert lost_tasks(SILENT, config(0)) == [("worker", 2, "gacli-node3:20448")]
    # Nothing named (the chief's own deadline): in a cluster of two, the other; of three, unknown.
    two = {"worker": CLUSTER["worker"][:2]}
    assert lost_tasks("Deadline Exceeded", config(1, two)) == [("worker", 0, "gacli-node1:20448")]
    assert lost_tasks("Deadline Exceeded", config(1)) == []


def test_the_message_names_the_node_the_reason_and_the_checkpoint():
    environ = {"TF_CONFIG": json.dumps(config(0))}
    message = str(lost_worker_error(SILENT, "/runs/a", "/runs/a/checkpoints/ckpt-3", 10, environ))
    assert message.startswith("lost the worker on gacli-node3 (worker 2, gacli-node3:20448): ")
    assert "no heartbeat within 10 s" in message and "ckpt-3" in message
    assert "resume=/runs/a" in message and "\n" not in message
    closed = str(lost_worker_error(RESET, "/runs/a", None, 60, environ))
    assert "its connection closed" in closed and "No checkpoint was written" in closed

"""A worker of a multi-worker cluster that was lost while training, named in one paragraph.

When a worker's process ends (its node died, or it was killed) the others learn it from a
connection that closes; when its node stops answering (a network cut, a frozen machine) they learn
it from TensorFlow's coordination service, which reports a worker silent for longer than its
heartbeat timeout (``strategy.peer_timeout_seconds``). Either way TensorFlow aborts the collectives
of every worker left with an error that names the lost task as ``/job:worker/replica:0/task:N``;
here it becomes the host and port of TF_CONFIG's worker N, and what to do next.

No TensorFlow import: the error is read as text.
"""

import json
import os
import re
import socket

from gacli.errors import ProcessUnusable, first_line

_TASK = re.compile(r"/job:(\w+)/(?:replica:\d+/)?task:(\d+)")
# TensorFlow's words for a lost peer, in the errors that abort a collective.
_SIGNS = (
    "heartbeat",
    "Connection reset",
    "Connection refused",
    "Socket closed",
    "failed to connect",
    "Collective ops is aborted",
    "unhealthy",
    "coordination service",
)


def is_lost_worker(error):
    """Whether ``error`` (a TensorFlow error) is the cluster's report of a lost worker."""
    import tensorflow as tf

    kinds = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError, tf.errors.AbortedError)
    text = str(error)
    return isinstance(error, tf.errors.OpError) and (
        isinstance(error, kinds) or any(sign in text for sign in _SIGNS)
    )


def lost_tasks(text, config):
    """[(task type, index, "host:port")] of the tasks other than this one that ``text`` names,
    in the order named; with none named in a cluster of two, the other one."""
    cluster, own = config.get("cluster", {}), config.get("task", {})
    me = (own.get("type", "worker"), int(own.get("index", 0)))
    found = []
    for kind, index in _TASK.findall(text):
        task = (kind, int(index))
        hosts = cluster.get(kind, [])
        if task != me and task[1] < len(hosts) and (*task, hosts[task[1]]) not in found:
            found.append((*task, hosts[task[1]]))
    if not found:
        others = [
            (kind, index, host)
            for kind, hosts in cluster.items()
            if isinstance(hosts, list)
            for index, host in enumerate(hosts)
            if (kind, index) != me
        ]
        found = others if len(others) == 1 else []
    return found


def lost_worker_error(error, run_dir, checkpoint, timeout_seconds, environ=None):
    """The :class:`ProcessUnusable` that ends this worker after another was lost: which one, why
    (its connection closed, or no heartbeat for ``timeout_seconds``), and how to go on from
    ``checkpoint`` (the newest checkpoint's path, or None). The collectives of this process stay
    aborted, so it exits at once."""
    environ = os.environ if environ is None else environ
    config = json.loads(environ.get("TF_CONFIG") or "{}")
    text = str(error)
    lost = lost_tasks(text, config)
    if lost:
        named = " and ".join(
            f"the {kind} on {host.rsplit(':', 1)[0]} ({kind} {index}, {host})"
            for kind, index, host in lost
        )
    else:
        named = "a worker of the cluster"
    if any(sign in text for sign in ("heartbeat", "unhealthy", "Deadline Exceeded")):
        # The chief holds the coordination service: a worker that loses it sees its heartbeat's
        # call time out (DeadlineExceeded), the chief sees a worker's heartbeats stop.
        why = f"it stopped answering (no heartbeat within {timeout_seconds} s)"
    elif any(sign in text for sign in ("Connection reset", "Connection refused", "Socket closed")):
        why = "its connection closed (its process ended, or its node went down)"
    else:
        why = f"TensorFlow reported: {first_line(error)}"
    task = config.get("task", {})
    me = f"{task.get('type', 'worker')} {task.get('index', 0)} on {socket.gethostname()}"
    kept = (
        f"The last checkpoint, {os.path.basename(checkpoint)}, is kept in {run_dir}: start the "
        "job again on nodes that answer (a SLURM requeue, or the same command with "
        f"resume={run_dir}) and every worker goes on from it."
        if checkpoint
        else "No checkpoint was written before it: start the job again on nodes that answer."
    )
    return ProcessUnusable(
        f"lost {named}: {why}. The workers train in lockstep, so this one ({me}) stops too, "
        f"with exit code 1. {kept} A worker silent for strategy.peer_timeout_seconds "
        f"({timeout_seconds} s) counts as lost; HYDRA_FULL_ERROR=1 shows TensorFlow's error."
    )

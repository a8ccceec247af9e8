"""Exec and port-forward on one pod with the official Kubernetes Python client.

    client_streams.py KUBECONFIG NAMESPACE POD PORT

Runs a few commands in the pod's first container over `kubernetes.stream.stream` (the
client's WebSocket exec) and one HTTP GET to PORT over `kubernetes.stream.portforward`, and
prints what it saw as one JSON object on stdout:

    {"exec": [{"command": [...], "stdout": "...", "stderr": "...", "code": N}, ...],
     "forward": {"status": "HTTP/1.1 200 OK", "body": "...", "error": null}}

A failed call is reported in the JSON (as "failure"), not raised, so the caller sees every
result.
"""

import http.client
import json
import sys

from kubernetes import client, config
from kubernetes.stream import portforward, stream

COMMANDS = [["echo", "hi"], ["env"], ["sh", "-c", "exit 3"], ["ls"]]
STDIN = "line one\nline two\n"
TIMEOUT = 30


def run(api, namespace, pod, command, stdin=None):
    try:
        resp = stream(
            api.connect_get_namespaced_pod_exec,
            pod,
            namespace,
            command=command,
            stdin=stdin is not None,
            stdout=True,
            stderr=True,
            tty=False,
            _preload_content=False,
        )
        if stdin is not None:
            resp.write_stdin(stdin)
            resp.close_channel(0)  # half-closes stdin (the v5 protocol)
        resp.run_forever(timeout=TIMEOUT)
        out = {
            "command": command,
            "stdout": resp.read_stdout(),
            "stderr": resp.read_stderr(),
            "code": resp.returncode,
        }
        resp.close()
        return out
    except Exception as e:  # the caller compares what each pod gave
        return {"command": command, "failure": f"{type(e).__name__}: {e}"}


def forward(api, namespace, pod, port):
    try:
        pf = portforward(
            api.connect_get_namespaced_pod_portforward, pod, namespace, ports=str(port)
        )
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
        conn.sock = pf.socket(port)
        conn.request("GET", "/", headers={"Connection": "close"})
        answer = conn.getresponse()
        status = f"HTTP/{answer.version / 10:.1f} {answer.status} {answer.reason}"
        body = answer.read().decode()
        conn.close()
        pf.close()
        return {"status": status, "body": body, "error": pf.error(port)}
    except Exception as e:
        return {"failure": f"{type(e).__name__}: {e}"}


def main():
    kubeconfig, namespace, pod, port = sys.argv[1:5]
    config.load_kube_config(config_file=kubeconfig)
    api = client.CoreV1Api()
    results = [run(api, namespace, pod, c) for c in COMMANDS]
    results.append(run(api, namespace, pod, ["cat"], stdin=STDIN))
    print(
        json.dumps(
            {"exec": results, "forward": forward(api, namespace, pod, int(port))},
            indent=1,
        )
    )


if __name__ == "__main__":
    main()

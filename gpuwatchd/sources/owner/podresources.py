"""Which pod and container each GPU is allocated to, from the kubelet's pod-resources API
(v1 `List`, the API dcgm-exporter uses) over its unix socket.

`List` returns every pod on the node with its containers and, per container, the devices
of each extended resource allocated to it. GPUs are the resources whose name starts with
`nvidia.com/` (`nvidia.com/gpu`, the MIG strategy's `nvidia.com/mig-…`, renamed shared
resources such as `nvidia.com/gpu.shared`). Their device IDs are what the device plugin
announced: GPU UUIDs (NVIDIA's plugin; `<UUID>::<n>` for time-sliced replicas), GPU
indices (`deviceIDStrategy: index`), or `nvidia<N>` (GKE's plugin). MIG devices are
named by their MIG UUID (`MIG-…`, R470 and later; `::<n>` when time-sliced, as on EKS)
under `nvidia.com/mig-<profile>` (the plugin's mixed strategy) or `nvidia.com/gpu` (single
strategy), by `MIG-GPU-<UUID>/<GI>/<CI>` before R470, and by `nvidia<N>/gi<GI>` (with
`/vgpu<n>` when shared) on GKE; `device_key` turns the last two into `<GPU UUID>/gi<GI>`
and `<N>/gi<GI>` (dcgm-exporter maps the same forms to (GPU, GPU instance)). DRA claims
name no device here and are skipped.

The answer is kept for `refresh` seconds. A call that fails (the socket missing, the
kubelet down, `timeout` passed) gives no names, so owners fall back to the pod UID and
container ID from the cgroup, and the next call waits `retry` seconds: a poll never
waits longer than `timeout`, and a dead kubelet costs one timeout per `retry`.
Without grpcio and protobuf (the `kubernetes` extra) there are no names, said once.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
GPU_RESOURCES = "nvidia.com/"
MAX_MESSAGE = 16 << 20  # a List on a node with many pods can pass gRPC's 4 MiB default


@dataclass(frozen=True, slots=True)
class PodContainer:
    namespace: str
    pod: str
    container: str


_GKE_MIG = re.compile(r"nvidia([0-9]{1,4})/gi([0-9]{1,4})(?:/vgpu[0-9]+)?")
_OLD_MIG = re.compile(r"MIG-(GPU-[0-9a-fA-F-]+)/([0-9]{1,4})/[0-9]{1,4}")


def device_key(device_id: str) -> str:
    """The GPU or MIG device a device ID names: its UUID ("GPU-…", "MIG-…"), its index as
    text ("0"), or a MIG GPU instance as "<GPU UUID>/gi<GI>" or "<index>/gi<GI>"."""
    device_id = device_id.partition("::")[0]
    if device_id.startswith("nvidia") and device_id[6:].isdigit():
        return str(int(device_id[6:]))
    if (gke := _GKE_MIG.fullmatch(device_id)) is not None:
        return f"{int(gke[1])}/gi{int(gke[2])}"
    if (old := _OLD_MIG.fullmatch(device_id)) is not None:
        return f"{old[1]}/gi{int(old[2])}"
    return device_id


def instance_keys(
    index: int, uuid: str, gpu_instance: int, mig_uuids: tuple[str, ...]
) -> list[str]:
    """The device_keys that can name a MIG GPU instance: its MIG devices' UUIDs, then the
    pre-R470 and GKE forms."""
    return [*mig_uuids, f"{uuid}/gi{gpu_instance}", f"{index}/gi{gpu_instance}"]


def gpu_devices(response: Any) -> dict[str, PodContainer]:
    """device_key -> the pod container a ListPodResourcesResponse allocates it to."""
    devices: dict[str, PodContainer] = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            names = PodContainer(pod.namespace, pod.name, container.name)
            for allocated in container.devices:
                if allocated.resource_name.startswith(GPU_RESOURCES):
                    devices.update((device_key(d), names) for d in allocated.device_ids)
    return devices


class PodResources:
    def __init__(
        self,
        socket: str = SOCKET,
        timeout: float = 0.5,
        refresh: float = 10.0,
        retry: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.socket = os.path.abspath(socket)
        self.timeout, self.refresh, self.retry = timeout, refresh, retry
        self._clock = clock
        self._channel: Any = None
        self._stub: Any = None
        self._devices: dict[str, PodContainer] = {}
        self._next = float("-inf")
        self._failing = False

    def devices(self) -> dict[str, PodContainer]:
        """device_key -> pod container of every GPU allocated on this node ({}: unknown)."""
        now = self._clock()
        if now >= self._next:
            found = self._list()
            self._devices = found or {}
            self._next = now + (self.refresh if found is not None else self.retry)
        return self._devices

    def close(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            channel.close()

    def _list(self) -> dict[str, PodContainer] | None:
        if not os.path.exists(self.socket):
            return None  # no kubelet here: not a Kubernetes node, nothing to say
        try:
            stub, api = self._connect()
            response = stub.List(api.ListPodResourcesRequest(), timeout=self.timeout)
        except ImportError as e:
            self._fail(f"{e} (install gpuwatchd[kubernetes])")
            return None
        except Exception as e:  # grpc.RpcError: UNAVAILABLE, DEADLINE_EXCEEDED, PERMISSION_DENIED
            self._fail(_reason(e))
            return None
        if self._failing:
            log.info("pod-resources: %s answers again", self.socket)
            self._failing = False
        return gpu_devices(response)

    def _connect(self) -> tuple[Any, Any]:
        import grpc

        from gpuwatchd.sources.owner.podresources_v1 import api_pb2, api_pb2_grpc

        if self._stub is None:
            options = [("grpc.max_receive_message_length", MAX_MESSAGE)]
            self._channel = grpc.insecure_channel(f"unix://{self.socket}", options=options)
            self._stub = api_pb2_grpc.PodResourcesListerStub(self._channel)
        return self._stub, api_pb2

    def _fail(self, reason: str) -> None:
        if not self._failing:
            log.warning(
                "pod-resources: List on %s failed: %s; pods are named by UID until it "
                "answers (asked again every %gs)", self.socket, reason, self.retry,
            )  # fmt: skip
            self._failing = True


def _reason(error: Exception) -> str:
    code = getattr(error, "code", None)
    details = getattr(error, "details", None)
    if callable(code) and callable(details):
        return f"{code().name}: {details()}"
    return str(error) or type(error).__name__

"""The restricted Pod Security Standard (pod-security.kubernetes.io/enforce: restricted), applied to a pod as Pod
Security Admission applies it: every control of the baseline profile and of the restricted one, as the Kubernetes docs
(concepts/security/pod-security-standards) and the checks of k8s.io/pod-security-admission state them, for the
current policy version. Containers means containers, init containers and ephemeral containers. One relaxation of the
standard is not modelled (so this is stricter): a pod in a user namespace (hostUsers: false) may run as root.

`violations(pod)` names every control the pod breaks (empty: the namespace admits it)."""

from __future__ import annotations

BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.tcp_syncookies",
                "net.ipv4.ping_group_range", "net.ipv4.ip_unprivileged_port_start", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes", "net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem",
                "net.ipv4.tcp_slow_start_after_idle", "net.ipv4.tcp_notsent_lowat"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
RESTRICTED_VOLUMES = {"configMap", "downwardAPI", "emptyDir", "projected", "secret", "csi", "persistentVolumeClaim",
                      "ephemeral", "image"}
PROBES = ("livenessProbe", "readinessProbe", "startupProbe")


def _containers(spec: dict) -> list[dict]:
    return [*(spec.get("containers") or []), *(spec.get("initContainers") or []),
            *(spec.get("ephemeralContainers") or [])]


def violations(pod: dict) -> list[str]:
    """Every control of the restricted profile that `pod` ({metadata, spec}) breaks."""
    spec, meta = pod["spec"], pod.get("metadata") or {}
    pod_sc = spec.get("securityContext") or {}
    found: list[str] = []

    def container_sc(c):
        return c.get("securityContext") or {}

    # ------------------------------------------------------------------------------------------ baseline
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            found.append(f"host namespaces: spec.{field}=true")
    if (pod_sc.get("windowsOptions") or {}).get("hostProcess") or any(
            (container_sc(c).get("windowsOptions") or {}).get("hostProcess") for c in _containers(spec)):
        found.append("HostProcess: windowsOptions.hostProcess=true")
    for c in _containers(spec):
        sc, name = container_sc(c), c["name"]
        if sc.get("privileged"):
            found.append(f"privileged: container {name}")
        if added := set((sc.get("capabilities") or {}).get("add") or []) - BASELINE_CAPABILITIES:
            found.append(f"capabilities (baseline): container {name} adds {sorted(added)}")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            found.append(f"host ports: container {name}")
        for where in [*(c.get(p) for p in PROBES), *((c.get("lifecycle") or {}).values())]:
            if where and any((where.get(kind) or {}).get("host") for kind in ("httpGet", "tcpSocket")):
                found.append(f"probe or lifecycle host: container {name}")
        if sc.get("procMount") not in (None, "Default"):
            found.append(f"/proc mount: container {name} procMount={sc['procMount']}")
    if any("hostPath" in v for v in spec.get("volumes") or []):
        found.append("hostPath volumes")
    for key, value in (meta.get("annotations") or {}).items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and not (
                value in ("", "runtime/default") or value.startswith("localhost/")):
            found.append(f"AppArmor: annotation {key}={value}")
    for where, sc in [("pod", pod_sc), *((f"container {c['name']}", container_sc(c)) for c in _containers(spec))]:
        if (sc.get("appArmorProfile") or {}).get("type") not in (None, "RuntimeDefault", "Localhost"):
            found.append(f"AppArmor: {where} appArmorProfile.type={sc['appArmorProfile']['type']}")
        selinux = sc.get("seLinuxOptions") or {}
        if selinux.get("type", "") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
            found.append(f"SELinux: {where} seLinuxOptions={selinux}")
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            found.append(f"seccomp: {where} Unconfined")
    if unsafe := {s["name"] for s in pod_sc.get("sysctls") or []} - SAFE_SYSCTLS:
        found.append(f"sysctls: {sorted(unsafe)}")

    # ------------------------------------------------------------------------------------------ restricted
    for v in spec.get("volumes") or []:
        if kinds := set(v) - {"name"} - RESTRICTED_VOLUMES:
            found.append(f"volume types: volume {v['name']} is {sorted(kinds)}")
    pod_non_root = pod_sc.get("runAsNonRoot")
    if pod_non_root is False:
        found.append("running as non-root: pod sets runAsNonRoot=false")
    if pod_sc.get("runAsUser") == 0:
        found.append("running as non-root user: pod runAsUser=0")
    pod_seccomp_ok = (pod_sc.get("seccompProfile") or {}).get("type") in ("RuntimeDefault", "Localhost")
    for c in _containers(spec):
        sc, name = container_sc(c), c["name"]
        if sc.get("allowPrivilegeEscalation") is not False:
            found.append(f"privilege escalation: container {name} does not set allowPrivilegeEscalation=false")
        if sc.get("runAsNonRoot") is False or (sc.get("runAsNonRoot") is None and pod_non_root is not True):
            found.append(f"running as non-root: container {name} (and not the pod) sets runAsNonRoot=true")
        if sc.get("runAsUser") == 0:
            found.append(f"running as non-root user: container {name} runAsUser=0")
        seccomp = (sc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost") and not (seccomp is None and pod_seccomp_ok):
            found.append(f"seccomp: container {name} (and not the pod) sets RuntimeDefault or Localhost")
        capabilities = sc.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            found.append(f"capabilities: container {name} does not drop ALL")
        if set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}:
            found.append(f"capabilities: container {name} adds more than NET_BIND_SERVICE")
    return found

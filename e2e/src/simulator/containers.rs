//! A simulated pod's containers as the kubelet API reads them: the pod by name, a
//! container's status, and the log of its current or last run. The log endpoint and the
//! streams (attach follows a container's log) both read them.

use http::StatusCode;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{ContainerStatus, Pod};

use super::Inner;
use super::logs::LogSource;

/// The simulated pod `ns/pod`, as the simulator last wrote it.
pub(super) fn lookup(inner: &Inner, ns: &str, pod: &str) -> Option<Pod> {
    inner
        .pods
        .read()
        .ok()?
        .get(&(ns.to_owned(), pod.to_owned()))
        .cloned()
}

/// The status of `container` (a regular or an init container) of `pod`.
pub(super) fn container_status<'a>(pod: &'a Pod, container: &str) -> Option<&'a ContainerStatus> {
    let status = pod.status.as_ref()?;
    status
        .container_statuses
        .iter()
        .chain(status.init_container_statuses.iter())
        .flatten()
        .find(|c| c.name == container)
}

/// The log source of the current (or, with `previous`, the last terminated) run.
pub(super) fn source(
    pod: &Pod,
    ns: &str,
    name: &str,
    container: &str,
    previous: bool,
) -> Result<LogSource, (StatusCode, String)> {
    let known = pod
        .spec
        .iter()
        .flat_map(|s| s.containers.iter().chain(s.init_containers.iter().flatten()))
        .any(|c| c.name == container);
    if !known {
        return Err((
            StatusCode::BAD_REQUEST,
            format!("container \"{container}\" is not valid for pod \"{name}\""),
        ));
    }
    let waiting = || {
        (
            StatusCode::BAD_REQUEST,
            format!("container \"{container}\" in pod \"{name}\" is waiting to start: ContainerCreating"),
        )
    };
    let status = container_status(pod, container).ok_or_else(waiting)?;
    let state = if previous {
        status.last_state.as_ref()
    } else {
        status.state.as_ref()
    };
    let lines = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(tensile_common::names::SIM_BEHAVIOR))
        .and_then(|b| super::behavior::Behavior::parse(b).ok())
        .and_then(|b| b.log_lines);
    let make = |started: Option<Timestamp>, finished: Option<Timestamp>| {
        started.map(|started| LogSource {
            namespace: ns.to_owned(),
            pod: name.to_owned(),
            container: container.to_owned(),
            started,
            finished,
            lines,
        })
    };
    let found = state.and_then(|s| {
        if let Some(r) = &s.running {
            make(r.started_at.as_ref().map(|t| t.0), None)
        } else if let Some(t) = &s.terminated {
            make(
                t.started_at.as_ref().map(|t| t.0),
                Some(t.finished_at.as_ref().map(|t| t.0).unwrap_or_else(Timestamp::now)),
            )
        } else {
            None
        }
    });
    match (found, previous) {
        (Some(src), _) => Ok(src),
        (None, true) => Err((
            StatusCode::BAD_REQUEST,
            format!("previous terminated container \"{container}\" in pod \"{name}\" not found"),
        )),
        (None, false) => {
            // A container between runs shows its last run's log, as the kubelet does.
            let last = status.last_state.as_ref().and_then(|s| s.terminated.as_ref());
            last.and_then(|t| {
                make(
                    t.started_at.as_ref().map(|t| t.0),
                    t.finished_at.as_ref().map(|t| t.0),
                )
            })
            .ok_or_else(waiting)
        }
    }
}

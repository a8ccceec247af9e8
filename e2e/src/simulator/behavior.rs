//! How a simulated pod behaves, chosen per pod by the `tensile.io/sim` annotation.
//!
//! The annotation is a comma-separated list of `key=value` settings; unknown keys and bad
//! values are errors (the simulator fails the pod with the message, so a typo is visible):
//!
//! | key | meaning | default |
//! |---|---|---|
//! | `start` | delay from binding to Running | `100ms` |
//! | `run` | how long each container run lasts | `1s` when `restartPolicy` is `Never`/`OnFailure`, forever for `Always` |
//! | `exit` | exit code a run ends with | `0` |
//! | `reason` | termination reason | `Completed` for exit 0, `Error` otherwise |
//! | `restarts` | how many times an ending container is restarted (`Always`, or `OnFailure` with a non-zero exit); after that it waits in `CrashLoopBackOff` | unlimited |
//! | `backoff` | delay before a restart | `500ms` |
//! | `stop` | how long a container takes to stop after a graceful delete (capped by the grace period) | `0s` |
//! | `lines` | log lines a container run writes (one a second from its start); then it is quiet | unlimited |
//! | `resize` | how long an allocated in-place resize is in progress before the containers run with it | `100ms` |
//!
//! Durations take `ms`, `s` or `m`. Example: `tensile.io/sim: "run=2s,exit=3,reason=OOMKilled"`.
//!
//! Every container of the pod runs with these settings; whether one restarts when it exits
//! is the kubelet's decision ([`restart_on_exit`]): its own `restartPolicy` and
//! `restartPolicyRules`, else the pod's `restartPolicy`.

use std::time::Duration;

use k8s_openapi::api::core::v1::Container;

/// A pod's restart policy, as the kubelet reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestartPolicy {
    Always,
    OnFailure,
    Never,
}

impl RestartPolicy {
    pub fn parse(policy: Option<&str>) -> Self {
        match policy {
            Some("Never") => Self::Never,
            Some("OnFailure") => Self::OnFailure,
            _ => Self::Always,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Behavior {
    pub start: Duration,
    pub run: Option<Duration>,
    pub exit: i32,
    pub reason: Option<String>,
    pub restarts: Option<u32>,
    pub backoff: Duration,
    pub stop: Duration,
    pub log_lines: Option<u64>,
    pub resize: Duration,
}

impl Default for Behavior {
    fn default() -> Self {
        Self {
            start: Duration::from_millis(100),
            run: None,
            exit: 0,
            reason: None,
            restarts: None,
            backoff: Duration::from_millis(500),
            stop: Duration::ZERO,
            log_lines: None,
            resize: Duration::from_millis(100),
        }
    }
}

/// What the kubelet restarts when a container exits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Restart {
    /// The container itself.
    Container,
    /// Every container of the pod, init containers again first (the `RestartAllContainers`
    /// action of a restart rule).
    AllContainers,
}

/// What the kubelet restarts when `container` of a pod with `policy` exits with `exit`, as
/// 1.37 decides it: a container-level `restartPolicy` (container restart rules, KEP-5307,
/// beta and on from 1.35) overrides the pod's, and the first of its `restartPolicyRules`
/// whose `exitCodes` match (`In` or `NotIn` the values) decides before it: `Restart`, or
/// `RestartAllContainers` (KEP-5532, beta and on from 1.36). The apiservers that lack these
/// fields drop or refuse them, so there they never reach a kubelet.
pub fn restart_on_exit(container: &Container, policy: RestartPolicy, exit: i32) -> Option<Restart> {
    let by_policy = |policy: RestartPolicy| match policy {
        RestartPolicy::Always => Some(Restart::Container),
        RestartPolicy::OnFailure => (exit != 0).then_some(Restart::Container),
        RestartPolicy::Never => None,
    };
    let Some(own) = container.restart_policy.as_deref() else {
        return by_policy(policy);
    };
    let rule = container.restart_policy_rules.iter().flatten().find(|rule| {
        rule.exit_codes.as_ref().is_some_and(|codes| {
            let listed = codes.values.iter().flatten().any(|v| *v == exit);
            match codes.operator.as_str() {
                "In" => listed,
                "NotIn" => !listed,
                _ => false,
            }
        })
    });
    match rule.map(|r| r.action.as_str()) {
        Some("Restart") => return Some(Restart::Container),
        Some("RestartAllContainers") => return Some(Restart::AllContainers),
        _ => {}
    }
    match own {
        "Always" | "OnFailure" | "Never" => by_policy(RestartPolicy::parse(Some(own))),
        _ => by_policy(policy),
    }
}

/// What happens when a container run ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AfterExit {
    /// The container stays terminated.
    Stays,
    /// It starts again after the backoff (with every container of the pod for
    /// [`Restart::AllContainers`]).
    Restart(Restart),
    /// The restart budget is spent: the container waits in CrashLoopBackOff.
    CrashLoop,
}

impl Behavior {
    /// Parses the annotation value.
    pub fn parse(spec: &str) -> Result<Self, String> {
        let mut b = Behavior::default();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (key, value) = item
                .split_once('=')
                .ok_or_else(|| format!("{item:?} is not key=value"))?;
            let (key, value) = (key.trim(), value.trim());
            let bad = |what: &str| format!("{key}={value:?}: {what}");
            match key {
                "start" => b.start = duration(value).map_err(|e| bad(&e))?,
                "run" => b.run = Some(duration(value).map_err(|e| bad(&e))?),
                "exit" => b.exit = value.parse().map_err(|_| bad("not an exit code"))?,
                "reason" if !value.is_empty() => b.reason = Some(value.to_owned()),
                "reason" => return Err(bad("empty reason")),
                "restarts" => b.restarts = Some(value.parse().map_err(|_| bad("not a count"))?),
                "backoff" => b.backoff = duration(value).map_err(|e| bad(&e))?,
                "stop" => b.stop = duration(value).map_err(|e| bad(&e))?,
                "lines" => b.log_lines = Some(value.parse().map_err(|_| bad("not a count"))?),
                "resize" => b.resize = duration(value).map_err(|e| bad(&e))?,
                other => {
                    return Err(format!(
                        "unknown key {other:?} (known: start, run, exit, reason, restarts, backoff, stop, lines, resize)"
                    ));
                }
            }
        }
        Ok(b)
    }

    /// Length of a container run under `policy`; `None` runs until deleted.
    pub fn run_for(&self, policy: RestartPolicy) -> Option<Duration> {
        match (self.run, policy) {
            (Some(d), _) => Some(d),
            (None, RestartPolicy::Always) => None,
            (None, _) => Some(Duration::from_secs(1)),
        }
    }

    /// Termination reason for an exit code.
    pub fn reason_for(&self, exit: i32) -> String {
        match &self.reason {
            Some(r) => r.clone(),
            None if exit == 0 => "Completed".into(),
            None => "Error".into(),
        }
    }

    /// What happens when a run ends, the kubelet wanting `restart` (see [`restart_on_exit`]),
    /// after `restarts_so_far` restarts.
    pub fn after_exit(&self, restart: Option<Restart>, restarts_so_far: u32) -> AfterExit {
        let Some(restart) = restart else {
            return AfterExit::Stays;
        };
        match self.restarts {
            Some(max) if restarts_so_far >= max => AfterExit::CrashLoop,
            _ => AfterExit::Restart(restart),
        }
    }
}

fn duration(s: &str) -> Result<Duration, String> {
    let (num, unit) = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .map(|i| s.split_at(i))
        .ok_or_else(|| "a duration needs a unit (ms, s, m)".to_string())?;
    let n: f64 = num.parse().map_err(|_| "not a number".to_string())?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" => n,
        "m" => n * 60.0,
        _ => return Err(format!("unknown unit {unit:?} (ms, s, m)")),
    };
    Duration::try_from_secs_f64(secs).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_the_restart_policy() {
        let b = Behavior::parse("").unwrap();
        assert_eq!(b, Behavior::default());
        assert_eq!(b.run_for(RestartPolicy::Always), None);
        assert_eq!(b.run_for(RestartPolicy::Never), Some(Duration::from_secs(1)));
        assert_eq!(b.run_for(RestartPolicy::OnFailure), Some(Duration::from_secs(1)));
    }

    #[test]
    fn every_key_parses() {
        let b = Behavior::parse(
            "start=2s, run=1.5s,exit=3,reason=OOMKilled,restarts=2,backoff=10ms,stop=1m,lines=4,resize=3s",
        )
        .unwrap();
        assert_eq!(b.start, Duration::from_secs(2));
        assert_eq!(b.run, Some(Duration::from_millis(1500)));
        assert_eq!(b.exit, 3);
        assert_eq!(b.reason_for(3), "OOMKilled");
        assert_eq!(b.restarts, Some(2));
        assert_eq!(b.backoff, Duration::from_millis(10));
        assert_eq!(b.stop, Duration::from_secs(60));
        assert_eq!(b.log_lines, Some(4));
        assert_eq!(b.resize, Duration::from_secs(3));
    }

    #[test]
    fn bad_input_is_named() {
        for (spec, needle) in [
            ("start", "not key=value"),
            ("start=5", "needs a unit"),
            ("start=5h", "unknown unit"),
            ("exit=x", "exit=\"x\""),
            ("colour=red", "unknown key \"colour\""),
            ("reason=", "empty reason"),
            ("run=-1s", "run="),
        ] {
            let err = Behavior::parse(spec).unwrap_err();
            assert!(err.contains(needle), "{spec}: {err}");
        }
    }

    fn container(value: serde_json::Value) -> Container {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn exits_follow_the_kubelet_rules() {
        let b = Behavior::default();
        let plain = container(serde_json::json!({"name": "app"}));
        let after = |policy, exit, restarts| b.after_exit(restart_on_exit(&plain, policy, exit), restarts);
        assert_eq!(after(RestartPolicy::Never, 0, 0), AfterExit::Stays);
        assert_eq!(after(RestartPolicy::Never, 3, 0), AfterExit::Stays);
        assert_eq!(after(RestartPolicy::OnFailure, 0, 5), AfterExit::Stays);
        assert_eq!(
            after(RestartPolicy::OnFailure, 1, 5),
            AfterExit::Restart(Restart::Container)
        );
        assert_eq!(
            after(RestartPolicy::Always, 0, 100),
            AfterExit::Restart(Restart::Container)
        );
        let limited = Behavior::parse("restarts=2").unwrap();
        assert_eq!(
            limited.after_exit(Some(Restart::Container), 1),
            AfterExit::Restart(Restart::Container)
        );
        assert_eq!(
            limited.after_exit(Some(Restart::Container), 2),
            AfterExit::CrashLoop
        );
        assert_eq!(b.reason_for(0), "Completed");
        assert_eq!(b.reason_for(2), "Error");
    }

    #[test]
    fn a_containers_own_policy_and_rules_override_the_pods() {
        let ruled = container(
            serde_json::json!({"name": "app", "restartPolicy": "Never", "restartPolicyRules": [
                {"action": "Restart", "exitCodes": {"operator": "In", "values": [42, 43]}},
                {"action": "RestartAllContainers", "exitCodes": {"operator": "NotIn", "values": [0, 42, 43]}},
            ]}),
        );
        assert_eq!(
            restart_on_exit(&ruled, RestartPolicy::Never, 42),
            Some(Restart::Container)
        );
        assert_eq!(
            restart_on_exit(&ruled, RestartPolicy::Never, 43),
            Some(Restart::Container)
        );
        assert_eq!(
            restart_on_exit(&ruled, RestartPolicy::Never, 1),
            Some(Restart::AllContainers)
        );
        // No rule matches: the container's own policy, not the pod's.
        assert_eq!(restart_on_exit(&ruled, RestartPolicy::Always, 0), None);
        let own = container(serde_json::json!({"name": "app", "restartPolicy": "OnFailure"}));
        assert_eq!(
            restart_on_exit(&own, RestartPolicy::Never, 1),
            Some(Restart::Container)
        );
        assert_eq!(restart_on_exit(&own, RestartPolicy::Always, 0), None);
        let always = container(serde_json::json!({"name": "app", "restartPolicy": "Always"}));
        assert_eq!(
            restart_on_exit(&always, RestartPolicy::Never, 0),
            Some(Restart::Container)
        );
    }
}

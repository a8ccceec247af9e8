//! The simulated container log: deterministic lines a test can predict.
//!
//! A container writes line `i` at `startedAt + i` seconds, reading
//! `<namespace>/<pod> <container> line <i>`, until it terminates. The kubelet's log options
//! select from that sequence exactly as they would from a real log file. A container told to
//! write only so many lines (`lines=N` in its behaviour) is quiet afterwards.

use jiff::{SignedDuration, Timestamp};
pub use tensile_common::kubelet::LogOptions;

/// One container run's log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogSource {
    pub namespace: String,
    pub pod: String,
    pub container: String,
    pub started: Timestamp,
    /// When the run ended; `None` while it runs.
    pub finished: Option<Timestamp>,
    /// Lines the run writes at most; `None`: one a second for as long as it runs.
    pub lines: Option<u64>,
}

impl LogSource {
    /// Time of line `i`.
    pub fn time_of(&self, i: u64) -> Timestamp {
        self.started
            .checked_add(SignedDuration::from_secs(i as i64))
            .unwrap_or(self.started)
    }

    /// Text of line `i`, newline included.
    pub fn render(&self, i: u64, timestamps: bool) -> String {
        let text = format!("{}/{} {} line {i}", self.namespace, self.pod, self.container);
        if timestamps {
            format!("{} {text}\n", self.time_of(i))
        } else {
            format!("{text}\n")
        }
    }

    /// Number of lines written by `now` (line 0 is written at start).
    pub fn written_by(&self, now: Timestamp) -> u64 {
        let end = match self.finished {
            Some(f) if f < now => f,
            _ => now,
        };
        let secs = end.duration_since(self.started).as_secs();
        let written = if secs < 0 { 0 } else { secs as u64 + 1 };
        self.lines.map_or(written, |most| written.min(most))
    }

    /// The first line to send for `options` at `now`, and the end (exclusive) of what is
    /// written so far.
    pub fn window(&self, options: &LogOptions, now: Timestamp) -> (u64, u64) {
        let end = self.written_by(now);
        let mut first = 0;
        if let Some(since) = options.since(now) {
            let offset = since.duration_since(self.started).as_secs();
            // Line i is at started+i: the first line at or after `since`.
            first = if offset <= 0 { 0 } else { offset as u64 };
            let has_fraction = since.duration_since(self.started).subsec_nanos() > 0;
            if offset >= 0 && has_fraction {
                first += 1;
            }
        }
        if let Some(tail) = options.tail_lines {
            first = first.max(end.saturating_sub(tail));
        }
        (first.min(end), end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn src(finished: Option<i64>) -> LogSource {
        LogSource {
            namespace: "ns".into(),
            pod: "p".into(),
            container: "c".into(),
            started: Timestamp::from_second(1_000).unwrap(),
            finished: finished.map(|s| Timestamp::from_second(s).unwrap()),
            lines: None,
        }
    }

    fn at(s: i64) -> Timestamp {
        Timestamp::from_second(s).unwrap()
    }

    #[test]
    fn a_container_told_to_write_n_lines_is_quiet_afterwards() {
        let quiet = LogSource {
            lines: Some(2),
            ..src(None)
        };
        assert_eq!(quiet.written_by(at(1_000)), 1);
        assert_eq!(quiet.written_by(at(1_009)), 2);
    }

    #[test]
    fn lines_are_deterministic() {
        let s = src(None);
        assert_eq!(s.render(3, false), "ns/p c line 3\n");
        assert_eq!(s.render(0, true), "1970-01-01T00:16:40Z ns/p c line 0\n");
        assert_eq!(s.written_by(at(999)), 0);
        assert_eq!(s.written_by(at(1_000)), 1);
        assert_eq!(s.written_by(at(1_009)), 10);
        assert_eq!(src(Some(1_004)).written_by(at(2_000)), 5);
    }

    #[test]
    fn tail_and_since_select_like_the_kubelet() {
        let s = src(None);
        let now = at(1_009); // lines 0..=9 written
        let all = LogOptions::default();
        assert_eq!(s.window(&all, now), (0, 10));
        let tail = LogOptions {
            tail_lines: Some(3),
            ..Default::default()
        };
        assert_eq!(s.window(&tail, now), (7, 10));
        let since = LogOptions {
            since_seconds: Some(4),
            ..Default::default()
        };
        assert_eq!(s.window(&since, now), (5, 10));
        let since_time = LogOptions {
            since_time: Some(at(1_002)),
            tail_lines: Some(100),
            ..Default::default()
        };
        assert_eq!(s.window(&since_time, now), (2, 10));
        let before_start = LogOptions {
            since_time: Some(at(10)),
            ..Default::default()
        };
        assert_eq!(s.window(&before_start, now), (0, 10));
        let zero_tail = LogOptions {
            tail_lines: Some(0),
            ..Default::default()
        };
        assert_eq!(s.window(&zero_tail, now), (10, 10));
    }
}

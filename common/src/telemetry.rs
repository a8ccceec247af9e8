//! Logging set-up shared by every binary: `tracing` with an env filter and plain or JSON
//! output, configured by the same flags everywhere.

use tracing_subscriber::EnvFilter;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    #[default]
    Plain,
    Json,
}

/// Logging flags, flattened into every binary.
#[derive(Clone, Debug, clap::Args)]
pub struct LogArgs {
    /// Log filter in `tracing` env-filter syntax (for example `info,tensile=debug`).
    #[arg(long = "log-level", env = "TENSILE_LOG", default_value = "info")]
    pub level: String,
    /// Log output format.
    #[arg(long = "log-format", env = "TENSILE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Plain)]
    pub format: LogFormat,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("--log-level {0:?} is not a valid filter: {1}")]
    Filter(String, String),
    #[error("logging was already initialised")]
    AlreadySet,
}

/// What the filter adds unless it names `kube_runtime` itself: kube's controller opens an
/// info span around every reconcile (its object and reason, formatted), which costs each
/// reconcile an allocation and every poll of it a span entry and exit, and says nothing the
/// suite's own messages (which name the object) do not.
const QUIET_KUBE_CONTROLLER: &str = "kube_runtime::controller=warn";

/// The filter of `level`: [`QUIET_KUBE_CONTROLLER`] added unless `level` names `kube_runtime`.
fn filter_of(level: &str) -> Result<EnvFilter, Error> {
    let wanted = if level.contains("kube_runtime") {
        level.to_owned()
    } else if level.trim().is_empty() {
        QUIET_KUBE_CONTROLLER.to_owned()
    } else {
        format!("{level},{QUIET_KUBE_CONTROLLER}")
    };
    EnvFilter::try_new(wanted).map_err(|e| Error::Filter(level.to_owned(), e.to_string()))
}

/// Installs the global subscriber; logs go to standard error.
pub fn init(args: &LogArgs) -> Result<(), Error> {
    let filter = filter_of(&args.level)?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let result = match args.format {
        LogFormat::Plain => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
    result.map_err(|_| Error::AlreadySet)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_invalid_filter_is_reported_with_the_flag() {
        let args = LogArgs {
            level: "info,=[".into(),
            format: LogFormat::Plain,
        };
        let err = init(&args).unwrap_err();
        assert!(err.to_string().contains("--log-level"), "{err}");
    }

    #[test]
    fn kubes_reconcile_spans_are_off_unless_the_filter_names_kube_runtime() {
        use tracing_subscriber::layer::SubscriberExt;
        // Whether, under the filter of `level`, kube's reconcile span (its target and level)
        // is made, and an info event of the suite is logged.
        let enabled = |level: &str| {
            let subscriber = tracing_subscriber::registry().with(filter_of(level).unwrap());
            tracing::subscriber::with_default(subscriber, || {
                let span = tracing::info_span!(target: "kube_runtime::controller", "reconciling object");
                let ours = tracing::info_span!(target: "tensile_virtual_node::act::pods", "ours");
                (!span.is_disabled(), !ours.is_disabled())
            })
        };
        assert_eq!(enabled("info"), (false, true));
        assert_eq!(enabled("debug"), (false, true));
        assert_eq!(enabled(""), (false, false));
        // A filter that names kube_runtime is taken as written.
        assert_eq!(enabled("info,kube_runtime=info"), (true, true));
        assert_eq!(enabled("warn,kube_runtime::controller=debug"), (true, false));
    }
}

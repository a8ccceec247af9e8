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

/// Installs the global subscriber; logs go to standard error.
pub fn init(args: &LogArgs) -> Result<(), Error> {
    let filter =
        EnvFilter::try_new(&args.level).map_err(|e| Error::Filter(args.level.clone(), e.to_string()))?;
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
}

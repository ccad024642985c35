//! The command line: run the daemon or the extender, check a config,
//! install the enforcement library, or inspect the plugin sockets; as
//! `kubectl-gpu`, the kubectl plugin.

use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use futures::StreamExt;
use gpu_device_plugin::config::{Config, LogFormat};
use gpu_device_plugin::extender::ExtenderConfig;
use gpu_device_plugin::node::app::{self, Control};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::field::{RecordFields, Visit};
use tracing_subscriber::fmt::FormatFields;
use tracing_subscriber::fmt::format::Writer;

#[derive(Parser)]
#[command(
    version = gpu_device_plugin::VERSION,
    about = "Kubernetes device plugin sharing NVIDIA GPUs by memory and compute"
)]
struct Cli {
    /// The TOML config; without one the built-in in-cluster default is used.
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the daemon (the default).
    Run,
    /// Validate a config and print the device plan.
    CheckConfig,
    /// Run the kube-scheduler extender (filter, prioritize, bind) on the
    /// config's `[extender]` section.
    SchedulerExtender,
    /// Exit 0 when the extender the config's `[extender]` section describes
    /// answers its `/readyz` with 200, else 1 with its reason: the extender
    /// container's readiness probe (it listens on loopback, out of reach of
    /// the kubelet's HTTP probes).
    ExtenderReady,
    /// Install HAMi-core's libvgpu.so into the host's library directory
    /// (the init container's job): checked, then written aside and renamed
    /// into place, so running containers keep the copy they opened.
    InstallEnforcement {
        /// The library to install (the image's copy).
        #[arg(long)]
        from: PathBuf,
        /// The host directory (the config's enforcement.library_dir).
        #[arg(long)]
        to: PathBuf,
    },
    /// Dial the plugin sockets in a device-plugin directory and report them.
    Inspect {
        /// The directory; default: the config's device_plugin_dir.
        #[arg(long)]
        dir: Option<PathBuf>,
    },
}

/// `kubectl gpu`: the binary installed as `kubectl-gpu` (kubectl's plugin
/// convention) runs this instead.
#[derive(Parser)]
#[command(
    name = "kubectl gpu",
    version = gpu_device_plugin::VERSION,
    about = "What each GPU share is granted and uses"
)]
struct KubectlGpu {
    #[command(subcommand)]
    command: GpuCommand,
}

#[derive(Subcommand)]
enum GpuCommand {
    /// Per node and GPU: what is granted to which pod (the API server)
    /// and what it uses (each node's daemon, through the API server).
    Top {
        /// Only this node.
        #[arg(long)]
        node: Option<String>,
        /// The shares of every namespace.
        #[arg(short = 'A', long)]
        all_namespaces: bool,
        /// The shares of this namespace (default: the context's).
        #[arg(short = 'n', long)]
        namespace: Option<String>,
        /// Default: $KUBECONFIG, else ~/.kube/config, else in-cluster.
        #[arg(long)]
        kubeconfig: Option<PathBuf>,
        /// Where the node daemons run.
        #[arg(long, default_value = "gpu-device-plugin")]
        daemon_namespace: String,
        /// The label selecting the node daemons' pods.
        #[arg(long, default_value = "app.kubernetes.io/name=gpu-device-plugin")]
        daemon_selector: String,
        /// The resource domain of the annotations.
        #[arg(long, default_value = "doslab.io")]
        resource_domain: String,
    },
}

/// True when run as `kubectl-gpu`, as kubectl runs a plugin.
fn as_kubectl_plugin() -> bool {
    let arg0 = std::env::args_os().next().map(PathBuf::from);
    let name = arg0.as_deref().and_then(|p| p.file_stem());
    name.is_some_and(|n| n == "kubectl-gpu")
}

async fn kubectl_gpu() -> anyhow::Result<()> {
    let GpuCommand::Top {
        node,
        all_namespaces,
        namespace,
        kubeconfig,
        daemon_namespace,
        daemon_selector,
        resource_domain,
    } = KubectlGpu::parse().command;
    let args = gpu_device_plugin::kubectl::TopArgs {
        node,
        all_namespaces,
        namespace,
        daemon_namespace,
        daemon_selector,
        domain: resource_domain,
        kubeconfig,
    };
    print!("{}", gpu_device_plugin::kubectl::top(&args).await?);
    Ok(())
}

fn init_logging(format: LogFormat, default_level: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    // Colour only on a terminal: `kubectl logs` and log shippers get plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().fmt_fields(SpanFields).init(),
        LogFormat::Text => builder.init(),
    }
}

/// Span fields as a JSON object for the JSON log. The formatter adds the
/// span's own name under `name`, and ractor's actor spans carry the actor's
/// name in a field `name` too: a duplicate key that parsers drop. Here that
/// field becomes `actor`.
struct SpanFields;

#[derive(Default)]
struct SpanVisitor(serde_json::Map<String, serde_json::Value>);

impl SpanVisitor {
    fn put(&mut self, field: &tracing::field::Field, value: serde_json::Value) {
        let key = match field.name() {
            "name" => "actor",
            other => other,
        };
        self.0.insert(key.to_owned(), value);
    }
}

impl Visit for SpanVisitor {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.put(field, format!("{value:?}").into());
    }
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.put(field, value.into());
    }
    fn record_i64(&mut self, field: &tracing::field::Field, value: i64) {
        self.put(field, value.into());
    }
    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        self.put(field, value.into());
    }
    fn record_bool(&mut self, field: &tracing::field::Field, value: bool) {
        self.put(field, value.into());
    }
}

impl<'writer> FormatFields<'writer> for SpanFields {
    fn format_fields<R: RecordFields>(
        &self,
        mut writer: Writer<'writer>,
        fields: R,
    ) -> std::fmt::Result {
        let mut visitor = SpanVisitor::default();
        fields.record(&mut visitor);
        write!(writer, "{}", serde_json::Value::Object(visitor.0))
    }

    fn add_fields(
        &self,
        current: &'writer mut tracing_subscriber::fmt::FormattedFields<Self>,
        fields: &tracing::span::Record<'_>,
    ) -> std::fmt::Result {
        let mut visitor = SpanVisitor::default();
        if !current.is_empty() {
            visitor.0 = serde_json::from_str(current).map_err(|_| std::fmt::Error)?;
        }
        fields.record(&mut visitor);
        current.fields = serde_json::Value::Object(visitor.0).to_string();
        Ok(())
    }
}

fn load(path: Option<&PathBuf>) -> anyhow::Result<Config> {
    let config = read(path)?;
    config.require_node_name()?;
    Ok(config)
}

/// The config, every value checked, but no node name required.
fn read(path: Option<&PathBuf>) -> anyhow::Result<Config> {
    match path {
        Some(p) => Config::read(p).with_context(|| format!("config {}", p.display())),
        None => Ok(Config::parse(
            gpu_device_plugin::config::DEFAULT_TOML,
            std::env::var("NODE_NAME").ok(),
        )?),
    }
}

/// check-config's report: the GPUs and what each resource advertises on them.
fn print_plan(config: &Config, plan: &gpu_device_plugin::rules::device::Plan) {
    for gpu in plan.gpus() {
        let numa = gpu
            .numa_node
            .map_or_else(|| "unknown".to_owned(), |n| n.to_string());
        println!(
            "  GPU {} {}  {} MiB  NUMA node {numa}",
            gpu.index, gpu.uuid, gpu.memory_mib
        );
    }
    for m in plan.models() {
        let bytes = m.worst_case_wire_len();
        println!(
            "  {:<24} {:>9} devices  ListAndWatch up to {} bytes ({:.1}% of the kubelet's 4 MiB)",
            config.resource_name(m.resource()),
            m.device_count(),
            bytes,
            100.0 * bytes as f64
                / gpu_device_plugin::rules::device::KUBELET_MAX_MESSAGE_BYTES as f64
        );
    }
}

/// SIGHUP → reload; SIGTERM, SIGINT → stop; and, given a config file to
/// watch, an edit whenever its content changes (a ConfigMap edit reaching
/// the node).
fn controls(
    watched: Option<&std::path::Path>,
) -> anyhow::Result<impl futures::Stream<Item = Control> + Unpin + use<>> {
    let signals = signal_hook_tokio::Signals::new([SIGHUP, SIGTERM, SIGINT])
        .context("cannot install signal handlers")?;
    let edits = match watched {
        Some(path) => Some(
            gpu_device_plugin::node::config_watch::watch(path)
                .with_context(|| format!("cannot watch {} for edits", path.display()))?,
        ),
        None => None,
    };
    let signals = signals.map(|sig| {
        let name = match sig {
            SIGHUP => "SIGHUP",
            SIGTERM => "SIGTERM",
            _ => "SIGINT",
        };
        tracing::info!(signal = name, "signal received");
        if sig == SIGHUP {
            Control::Reload
        } else {
            Control::Stop
        }
    });
    Ok(futures::stream::select(
        signals,
        futures::stream::iter(edits)
            .flatten()
            .map(|_edited| Control::Edited),
    ))
}

/// The extender's config from `path`, else its in-cluster default.
fn extender_config(path: Option<&std::path::Path>) -> anyhow::Result<ExtenderConfig> {
    Ok(match path {
        Some(p) => ExtenderConfig::load(p).with_context(|| format!("config {}", p.display()))?,
        None => ExtenderConfig::default(),
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    if as_kubectl_plugin() {
        return kubectl_gpu().await;
    }
    let cli = Cli::parse();
    match cli.command.unwrap_or(Command::Run) {
        Command::Run => {
            let config = load(cli.config.as_ref())?;
            init_logging(config.log_format, "info");
            let watched = cli.config.as_deref().filter(|_| config.watch_config);
            let controls = controls(watched)?;
            app::run(config, cli.config, controls).await?;
        }
        Command::SchedulerExtender => {
            let config = extender_config(cli.config.as_deref())?;
            init_logging(LogFormat::Text, "info");
            let mut controls = controls(None)?;
            let stop = async move {
                while let Some(c) = controls.next().await {
                    if matches!(c, Control::Stop) {
                        break;
                    }
                }
            };
            gpu_device_plugin::extender::run(config, stop).await?;
        }
        Command::ExtenderReady => {
            let config = extender_config(cli.config.as_deref())?;
            let timeout = std::time::Duration::from_secs(2);
            if let Err(e) = gpu_device_plugin::extender::ask_ready(&config, timeout).await {
                eprintln!("{e}");
                std::process::exit(1);
            }
            println!("ready");
        }
        Command::Inspect { dir } => {
            init_logging(LogFormat::Text, "warn");
            let dir = match (dir, &cli.config) {
                (Some(d), _) => d,
                (None, Some(_)) => load(cli.config.as_ref())?.device_plugin_dir,
                (None, None) => Config::default().device_plugin_dir,
            };
            anyhow::ensure!(dir.is_dir(), "{} is not a directory", dir.display());
            let reports = gpu_device_plugin::node::inspect::inspect(&dir).await;
            print!(
                "{}",
                gpu_device_plugin::node::inspect::render(&dir, &reports)
            );
            if reports.iter().any(|r| r.outcome.is_err()) {
                std::process::exit(2);
            }
        }
        Command::InstallEnforcement { from, to } => {
            init_logging(LogFormat::Text, "info");
            let done = gpu_device_plugin::node::enforcement::install_library(&from, &to)?;
            println!(
                "{}: {done:?}",
                to.join(gpu_device_plugin::node::enforcement::LIBRARY_FILE)
                    .display()
            );
        }
        Command::CheckConfig => {
            let config = read(cli.config.as_ref())?;
            let checked = app::check(&config).await?;
            println!("config OK");
            if let Some(plan) = &checked.plan {
                print_plan(&config, plan);
            }
            for note in &checked.notes {
                println!("  note: {note}");
            }
        }
    }
    Ok(())
}

//! The demo: the real daemon on mock GPUs, the kubelet, API-server and
//! scheduler stand-ins around it, then the extender placing pods; prints
//! what each step showed and fails if a step did not show it.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Warnings only by default: the report on stdout is the demo's output.
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
    print!("{}", gpu_sim::demo::run().await?);
    Ok(())
}

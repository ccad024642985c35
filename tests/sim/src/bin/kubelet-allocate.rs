//! Admits containers to a running daemon as the kubelet's device manager
//! would (the stand-in kubelet: registration, ListAndWatch,
//! GetPreferredAllocation, Allocate) and prints each container's grant as
//! the daemon answered it: the envs merged as the kubelet merges them, and
//! the mounts. The GPU measurements (`benches/gpu/`) start their workloads
//! from exactly these responses.
//!
//! `kubelet-allocate <device-plugin-dir> <container>...`, each container
//! `resource=amount[,resource=amount...]` with the resource's short name
//! (`gpu-core=30,gpu-memory=8192`). The containers are admitted in order
//! by one kubelet, so they never share a device ID. Prints one JSON array.

use std::time::Duration;

use anyhow::{Context, bail};
use gpu_sim::kubelet::{KubeletSim, merged_envs};

/// How long the daemon has to register every resource asked for.
const REGISTER_WAIT: Duration = Duration::from_secs(60);

fn parse_container(domain: &str, text: &str) -> anyhow::Result<Vec<(String, usize)>> {
    text.split(',')
        .map(|ask| {
            let (resource, amount) = ask
                .split_once('=')
                .with_context(|| format!("{ask:?}: want resource=amount"))?;
            let amount = amount
                .parse()
                .with_context(|| format!("{ask:?}: amount is not a count"))?;
            Ok((format!("{domain}/{resource}"), amount))
        })
        .collect()
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let dir = args
        .next()
        .context("usage: kubelet-allocate <device-plugin-dir> <container>...")?;
    let domain = std::env::var("RESOURCE_DOMAIN").unwrap_or_else(|_| "doslab.io".into());
    let containers = args
        .map(|c| parse_container(&domain, &c))
        .collect::<anyhow::Result<Vec<_>>>()?;
    if containers.is_empty() {
        bail!("no container to admit");
    }
    let wanted: Vec<String> = containers
        .iter()
        .flatten()
        .map(|(r, _)| r.clone())
        .collect();
    let kubelet = KubeletSim::start(dir.as_ref()).context("serving kubelet.sock")?;
    let registered = kubelet
        .wait_until(REGISTER_WAIT, |views| {
            wanted
                .iter()
                .all(|r| views.get(r).is_some_and(|v| v.stream_open && v.healthy > 0))
        })
        .await;
    if !registered {
        bail!("the daemon did not register {wanted:?} within {REGISTER_WAIT:?}");
    }
    let mut out = Vec::new();
    for asks in &containers {
        let grants = kubelet
            .admit(asks)
            .await
            .map_err(|e| anyhow::anyhow!("admitting {asks:?}: {e}"))?;
        let mounts: Vec<_> = grants
            .iter()
            .flat_map(|g| &g.response.mounts)
            .map(|m| {
                serde_json::json!({
                    "container_path": m.container_path,
                    "host_path": m.host_path,
                    "read_only": m.read_only,
                })
            })
            .collect();
        let devices: serde_json::Map<String, serde_json::Value> = grants
            .iter()
            .map(|g| (g.resource.clone(), g.device_ids.len().into()))
            .collect();
        out.push(serde_json::json!({
            "asks": devices,
            "envs": merged_envs(&grants),
            "mounts": mounts,
        }));
    }
    println!("{}", serde_json::to_string_pretty(&out)?);
    kubelet.stop().await;
    Ok(())
}

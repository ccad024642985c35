//! gRPC over unix sockets, both ways: the plugin serves on its socket and
//! dials the kubelet's; the kubelet simulator does the opposite.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::{Channel, Endpoint, Uri};

/// A channel to the gRPC server on `path`, connected now (fails fast if the
/// socket is missing) with `timeout` for the connection itself.
pub async fn connect(path: &Path, timeout: Duration) -> Result<Channel, tonic::transport::Error> {
    let path: PathBuf = path.to_owned();
    // The URI is required by the API but unused: the connector picks the socket.
    Endpoint::from_static("http://localhost")
        .connect_timeout(timeout)
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await
}

/// Binds `path`, removing a stale socket file first (a crashed predecessor
/// or a restarted kubelet leaves one behind).
pub fn bind(path: &Path) -> std::io::Result<UnixListenerStream> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    Ok(UnixListenerStream::new(UnixListener::bind(path)?))
}

const RECEIVE_WINDOW: u32 = 16 * 1024 * 1024;

/// Serves `router` on `incoming` until `shutdown` resolves.
pub async fn serve(
    router: tonic::service::Routes,
    incoming: UnixListenerStream,
    shutdown: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    tonic::transport::Server::builder()
        // GetPreferredAllocation requests run to megabytes; HTTP/2's default
        // 64 KiB window would cost a round trip per 64 KiB.
        .initial_stream_window_size(Some(RECEIVE_WINDOW))
        .initial_connection_window_size(Some(RECEIVE_WINDOW))
        .add_routes(router)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
}

/// Plugin sockets in a device-plugin directory: every socket but the
/// kubelet's, sorted.
pub fn plugin_sockets(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter(is_socket)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n != "kubelet.sock")
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

pub fn is_socket(entry: &std::fs::DirEntry) -> bool {
    use std::os::unix::fs::FileTypeExt;
    entry.file_type().is_ok_and(|t| t.is_socket())
}

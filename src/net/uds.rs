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
    // The connector picks the socket; the URI's host is only the `:authority`
    // the server sees. It must be `localhost`, as the kubelet (v1.26+) sends:
    // the h2 server under tonic refuses a socket path there.
    Endpoint::from_static("http://localhost")
        .connect_timeout(timeout)
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await
}

/// The longest path a unix socket can have: `sun_path` holds 108 bytes,
/// the terminating NUL included.
pub(crate) const MAX_SOCKET_PATH: usize = 107;

/// Proves that sockets can be bound in `dir` by binding (and removing) one:
/// a missing or read-only directory, or one this process may not write,
/// fails here with the kernel's reason rather than in every plugin restart.
pub(crate) fn check_bindable(dir: &Path) -> std::io::Result<()> {
    // No ".sock" suffix: the kubelet-watcher and `inspect` ignore the probe.
    tempfile::Builder::new()
        .prefix(".probe")
        .make_in(dir, |path| std::os::unix::net::UnixListener::bind(path))
        .map(drop)
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
    serve_streams(router, incoming, shutdown).await
}

/// [`serve`] for a socket whose clients may send a socket path as the
/// HTTP/2 `:authority` (the kubelet's plugin watcher): every connection
/// goes through [`crate::net::authority::relay`].
pub async fn serve_relayed(
    router: tonic::service::Routes,
    incoming: UnixListenerStream,
    shutdown: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    use tokio_stream::StreamExt;
    let relayed = incoming.map(|conn| conn.map(crate::net::authority::relay));
    serve_streams(router, relayed, shutdown).await
}

async fn serve_streams<IO>(
    router: tonic::service::Routes,
    incoming: impl tokio_stream::Stream<Item = std::io::Result<IO>>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error>
where
    IO: tokio::io::AsyncRead
        + tokio::io::AsyncWrite
        + tonic::transport::server::Connected
        + Unpin
        + Send
        + 'static,
    IO::ConnectInfo: Clone + Send + Sync + 'static,
{
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    use tonic::codegen::http;

    use crate::api::Empty;
    use crate::api::device_plugin_client::DevicePluginClient;

    #[tokio::test]
    async fn clients_send_localhost_as_the_authority() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("p.sock");
        let incoming = bind(&socket).unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let record = seen.clone();
        let capture =
            tower::util::MapRequestLayer::new(move |req: http::Request<tonic::body::Body>| {
                let authority = req.uri().authority().map(|a| a.to_string());
                record.lock().unwrap().push(authority);
                req
            });
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .layer(capture)
                .add_routes(tonic::service::Routes::default())
                .serve_with_incoming(incoming),
        );
        let channel = connect(&socket, Duration::from_secs(5)).await.unwrap();
        // No service is routed: the call fails, but only after the request
        // went through the server's HTTP/2 layer.
        let status = DevicePluginClient::new(channel)
            .get_device_plugin_options(Empty {})
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unimplemented, "{status}");
        assert_eq!(*seen.lock().unwrap(), [Some("localhost".to_owned())]);
        server.abort();
    }

    #[test]
    fn a_directory_that_cannot_take_a_socket_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        check_bindable(dir.path()).unwrap();
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "probe left behind"
        );
        let missing = check_bindable(&dir.path().join("nope")).unwrap_err();
        assert_eq!(missing.kind(), std::io::ErrorKind::NotFound);
        let file = dir.path().join("file");
        std::fs::write(&file, "").unwrap();
        assert!(check_bindable(&file).is_err());
    }
}

//! A relay in front of a gRPC server on a unix socket that replaces a
//! malformed HTTP/2 `:authority` with `localhost`.
//!
//! The kubelet's plugin watcher dials a plugin's registration socket with
//! the socket's path as the gRPC target and no authority of its own, so
//! grpc-go sends the path, percent-encoded (`%2Fvar%2Flib%2Fkubelet…`), as
//! `:authority` (kubernetes#108254; the device manager sets `localhost`,
//! the plugin watcher does not). The h2 server under tonic refuses such a
//! request with `PROTOCOL_ERROR` before any service sees it, so a Rust DRA
//! plugin could never register. Every connection therefore goes through
//! this relay: the client's header blocks are decoded (HPACK, with the
//! client's dynamic table), an `:authority` that is not a valid authority
//! becomes `localhost`, and the block is encoded again for the server; all
//! other frames, and everything the server sends, pass unchanged.

use std::io;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream};
use tokio::net::UnixStream;

/// The client connection preface (RFC 9113 §3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The largest frame payload a peer must accept without asking for more
/// (SETTINGS_MAX_FRAME_SIZE's initial value): re-encoded blocks are cut to it.
const MAX_FRAME: usize = 16_384;
/// The largest frame or header block the relay takes from a client. A
/// registration call's headers are a few hundred bytes; this bounds what a
/// hostile local client can make the daemon hold.
const MAX_BLOCK: usize = 1 << 20;
/// The buffer between the relay and the server.
const PIPE: usize = 64 * 1024;

/// Takes over `client` and returns the server's end of the relay: serve
/// that (tonic accepts any stream) instead of the socket itself.
pub(crate) fn relay(client: UnixStream) -> DuplexStream {
    let (server_end, relay_end) = tokio::io::duplex(PIPE);
    tokio::spawn(async move {
        let (from_client, mut to_client) = client.into_split();
        let (mut from_server, to_server) = tokio::io::split(relay_end);
        let up = rewrite(from_client, to_server);
        let down = async {
            tokio::io::copy(&mut from_server, &mut to_client).await?;
            to_client.shutdown().await
        };
        // Either side ending ends the connection; the error, if any, is the
        // client's to see (its stream breaks).
        let _ = tokio::try_join!(up, down);
    });
    server_end
}

fn invalid(why: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why.into())
}

/// Copies the client's frames to the server, rewriting header blocks.
async fn rewrite(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
) -> io::Result<()> {
    let mut preface = [0u8; PREFACE.len()];
    from.read_exact(&mut preface).await?;
    if &preface != PREFACE {
        return Err(invalid("not an HTTP/2 client preface"));
    }
    to.write_all(&preface).await?;
    let mut headers = HeaderBlocks::default();
    // A header block that CONTINUATION frames have not finished yet:
    // its stream, its HEADERS flags, and the fragments so far.
    let mut open: Option<(u32, u8, Vec<u8>)> = None;
    loop {
        let mut head = [0u8; 9];
        match from.read_exact(&mut head).await {
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return to.shutdown().await,
            other => other?,
        };
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let (kind, flags) = (head[3], head[4]);
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        if len > MAX_BLOCK {
            return Err(invalid(format!("a {len}-byte frame")));
        }
        let mut payload = vec![0u8; len];
        from.read_exact(&mut payload).await?;
        match (kind, open.take()) {
            (HEADERS, None) => {
                let fragment = header_fragment(flags, &payload)?;
                if flags & END_HEADERS != 0 {
                    let block = headers.rewrite(fragment)?;
                    write_block(&mut to, stream, flags, &block).await?;
                } else {
                    open = Some((stream, flags, fragment.to_vec()));
                }
            }
            (CONTINUATION, Some((id, first, mut block))) if id == stream => {
                block.extend_from_slice(&payload);
                if block.len() > MAX_BLOCK {
                    return Err(invalid("a header block over 1 MiB"));
                }
                if flags & END_HEADERS != 0 {
                    let block = headers.rewrite(&block)?;
                    write_block(&mut to, stream, first, &block).await?;
                } else {
                    open = Some((id, first, block));
                }
            }
            // RFC 9113 §6.10: nothing may come between a header block's frames.
            (_, Some(_)) | (CONTINUATION, None) => {
                return Err(invalid("a header block interrupted"));
            }
            (_, None) => {
                to.write_all(&head).await?;
                to.write_all(&payload).await?;
            }
        }
    }
}

/// A HEADERS frame's header block fragment, without padding or priority.
fn header_fragment(flags: u8, payload: &[u8]) -> io::Result<&[u8]> {
    let mut start = 0;
    let mut end = payload.len();
    if flags & PADDED != 0 {
        let pad = *payload.first().ok_or_else(|| invalid("no pad length"))? as usize;
        start = 1;
        end = end
            .checked_sub(pad)
            .ok_or_else(|| invalid("padding past the frame"))?;
    }
    if flags & PRIORITY != 0 {
        start += 5;
    }
    payload
        .get(start..end)
        .ok_or_else(|| invalid("a HEADERS frame too short for its flags"))
}

/// Writes `block` as one HEADERS frame and, past [`MAX_FRAME`], CONTINUATION
/// frames; only END_STREAM of the client's flags is kept (padding and
/// priority were dropped).
async fn write_block(
    to: &mut (impl AsyncWrite + Unpin),
    stream: u32,
    flags: u8,
    block: &[u8],
) -> io::Result<()> {
    let mut chunks = block.chunks(MAX_FRAME).peekable();
    let mut kind = HEADERS;
    let mut first_flags = flags & END_STREAM;
    // An empty block is still one frame.
    let empty: &[u8] = &[];
    let mut next = chunks.next().or(Some(empty));
    while let Some(chunk) = next {
        next = chunks.next();
        let last = if next.is_none() { END_HEADERS } else { 0 };
        let len = (chunk.len() as u32).to_be_bytes();
        let id = stream.to_be_bytes();
        let head = [
            len[1],
            len[2],
            len[3],
            kind,
            first_flags | last,
            id[0],
            id[1],
            id[2],
            id[3],
        ];
        to.write_all(&head).await?;
        to.write_all(chunk).await?;
        kind = CONTINUATION;
        first_flags = 0;
    }
    Ok(())
}

/// Both HPACK contexts of one connection: the client's blocks decoded with
/// its dynamic table, re-encoded with one of the relay's own, which the
/// server's decoder mirrors.
#[derive(Default)]
struct HeaderBlocks {
    decoder: loona_hpack::Decoder<'static>,
    encoder: loona_hpack::Encoder<'static>,
}

impl HeaderBlocks {
    fn rewrite(&mut self, block: &[u8]) -> io::Result<Vec<u8>> {
        let mut fields = self
            .decoder
            .decode(block)
            .map_err(|e| invalid(format!("HPACK: {e}")))?;
        for (name, value) in &mut fields {
            if name.as_slice() == b":authority"
                && http::uri::Authority::try_from(value.as_slice()).is_err()
            {
                *value = b"localhost".to_vec();
            }
        }
        Ok(self
            .encoder
            .encode(fields.iter().map(|(n, v)| (n.as_slice(), v.as_slice()))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = (payload.len() as u32).to_be_bytes();
        let mut out = vec![len[1], len[2], len[3], kind, flags];
        out.extend_from_slice(&stream.to_be_bytes());
        out.extend_from_slice(payload);
        out
    }

    /// What the server gets for `input` from a client: the frames, with
    /// each header block decoded.
    async fn relayed(input: Vec<u8>) -> io::Result<Vec<(u8, u8, u32, Vec<(Vec<u8>, Vec<u8>)>)>> {
        let mut out = Vec::new();
        rewrite(&input[..], &mut out).await?;
        assert_eq!(&out[..24], PREFACE);
        let mut frames = Vec::new();
        let mut decoder = loona_hpack::Decoder::new();
        let mut rest = &out[24..];
        while !rest.is_empty() {
            let len = u32::from_be_bytes([0, rest[0], rest[1], rest[2]]) as usize;
            let (kind, flags) = (rest[3], rest[4]);
            let stream = u32::from_be_bytes([rest[5], rest[6], rest[7], rest[8]]);
            let payload = &rest[9..9 + len];
            let fields = if kind == HEADERS {
                decoder.decode(payload).unwrap()
            } else {
                vec![(b"raw".to_vec(), payload.to_vec())]
            };
            frames.push((kind, flags, stream, fields));
            rest = &rest[9 + len..];
        }
        Ok(frames)
    }

    fn request(authority: &[u8]) -> Vec<(&'static [u8], Vec<u8>)> {
        vec![
            (b":method", b"POST".to_vec()),
            (b":scheme", b"http".to_vec()),
            (
                b":path",
                b"/pluginregistration.Registration/GetInfo".to_vec(),
            ),
            (b":authority", authority.to_vec()),
            (b"content-type", b"application/grpc".to_vec()),
        ]
    }

    fn encode(encoder: &mut loona_hpack::Encoder, fields: &[(&'static [u8], Vec<u8>)]) -> Vec<u8> {
        encoder.encode(fields.iter().map(|(n, v)| (*n, v.as_slice())))
    }

    #[tokio::test]
    async fn a_socket_path_authority_becomes_localhost_and_the_rest_passes() {
        let mut enc = loona_hpack::Encoder::new();
        let path = b"%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fgpu.doslab.io-reg.sock";
        let mut input = PREFACE.to_vec();
        input.extend(frame(0x4, 0, 0, &[0, 4, 0, 0, 0x40, 0]));
        // Split over HEADERS + CONTINUATION, padded, with a priority.
        let block = encode(&mut enc, &request(path));
        let (a, b) = block.split_at(block.len() / 2);
        let mut first = vec![3];
        first.extend_from_slice(&[0, 0, 0, 0, 16]);
        first.extend_from_slice(a);
        first.extend_from_slice(&[0, 0, 0]);
        input.extend(frame(HEADERS, PADDED | PRIORITY, 1, &first));
        input.extend(frame(CONTINUATION, END_HEADERS, 1, b));
        input.extend(frame(0x0, END_STREAM, 1, b"\0\0\0\0\0"));
        // A second request on the same connection: the client's dynamic
        // table now holds the first one's fields.
        input.extend(frame(
            HEADERS,
            END_HEADERS,
            3,
            &encode(&mut enc, &request(b"localhost")),
        ));
        let frames = relayed(input).await.unwrap();
        assert_eq!(frames.len(), 4, "{frames:?}");
        assert_eq!(frames[0].0, 0x4);
        let (kind, flags, stream, fields) = &frames[1];
        assert_eq!((*kind, *flags, *stream), (HEADERS, END_HEADERS, 1));
        let want: Vec<(Vec<u8>, Vec<u8>)> = request(b"localhost")
            .into_iter()
            .map(|(n, v)| (n.to_vec(), v))
            .collect();
        assert_eq!(fields, &want);
        assert_eq!(frames[2].0, 0x0);
        assert_eq!(frames[2].1, END_STREAM);
        assert_eq!(frames[3].3, want);
    }

    #[tokio::test]
    async fn a_valid_authority_is_kept() {
        let mut enc = loona_hpack::Encoder::new();
        let mut input = PREFACE.to_vec();
        let fields = request(b"example.com:80");
        input.extend(frame(
            HEADERS,
            END_HEADERS | END_STREAM,
            1,
            &encode(&mut enc, &fields),
        ));
        let frames = relayed(input).await.unwrap();
        assert_eq!(frames[0].1, END_HEADERS | END_STREAM);
        assert_eq!(frames[0].3[3].1, b"example.com:80");
    }

    #[tokio::test]
    async fn broken_input_ends_the_connection_with_a_reason() {
        let mut bad_preface = b"GET / HTTP/1.1\r\n\r\n1234567".to_vec();
        bad_preface.truncate(24);
        let interrupted = [
            PREFACE.to_vec(),
            frame(HEADERS, 0, 1, &[0x82]),
            frame(0x0, 0, 1, b"x"),
        ]
        .concat();
        let huge = [PREFACE.to_vec(), vec![0xff, 0xff, 0xff, 0, 0, 0, 0, 0, 1]].concat();
        let garbage = [
            PREFACE.to_vec(),
            frame(HEADERS, END_HEADERS, 1, &[0xff, 0xff]),
        ]
        .concat();
        let short = [
            PREFACE.to_vec(),
            frame(HEADERS, PADDED | END_HEADERS, 1, &[9, 1]),
        ]
        .concat();
        for input in [bad_preface, interrupted, huge, garbage, short] {
            let e = relayed(input).await.unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
        }
    }
}

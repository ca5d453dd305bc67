//! `kubectl port-forward` on the node, as the kubelet serves it (protocol `portforward.k8s.io`
//! over SPDY/3.1, `spdy`): for every forwarded connection the client opens an error stream and
//! a data stream with the same `requestid` and the pod's `port`; the node connects to that port
//! on the pod's loopback, inside its network namespace, and copies the data stream both ways.
//! A port nothing listens on is reported on the error stream, which kubectl prints.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::pin::Pin;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use super::spdy::{Frame, FrameWriter, HeaderInflater, read_frame};

/// The only streaming protocol served (what the kubelet also calls `portforward.k8s.io`).
pub const PROTOCOL: &str = "portforward.k8s.io";

/// Connects to a port of the pod; the error is what the client is told.
pub type Dial = Box<dyn Fn(u16) -> Pin<Box<dyn Future<Output = Result<TcpStream, String>> + Send>> + Send + Sync>;

/// DATA frames are sent in chunks of at most this much.
const CHUNK: usize = 32 * 1024;

/// The two streams of one forwarded connection, as they arrive.
#[derive(Default)]
struct Pair {
    error: Option<u32>,
    data: Option<(u32, u16)>,
}

/// Serves one upgraded connection until the client closes it.
pub async fn serve<IO: AsyncRead + AsyncWrite + Send + 'static>(io: IO, dial: Dial) -> io::Result<()> {
    let (mut reader, mut writer) = tokio::io::split(io);
    let (out, mut frames) = mpsc::channel::<Vec<u8>>(64);
    let writing = tokio::spawn(async move {
        while let Some(frame) = frames.recv().await {
            writer.write_all(&frame).await?;
        }
        writer.shutdown().await
    });
    let mut replies = FrameWriter::default();
    let mut inflater = HeaderInflater::new();
    let mut pairs: HashMap<String, Pair> = HashMap::new();
    // Client-to-pod bytes of each data stream; `None` is the client's FIN.
    let mut inbound: HashMap<u32, mpsc::Sender<Option<Vec<u8>>>> = HashMap::new();
    let dial = std::sync::Arc::new(dial);
    let result = loop {
        let frame = match read_frame(&mut reader, &mut inflater).await {
            Ok(Some(f)) => f,
            Ok(None) => break Ok(()),
            Err(e) => break Err(e),
        };
        match frame {
            Frame::SynStream { id, headers } => {
                if out.send(replies.syn_reply(id)).await.is_err() {
                    break Ok(());
                }
                let header = |name: &str| headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.clone());
                let request = header("requestid").unwrap_or_default();
                let pair = pairs.entry(request.clone()).or_default();
                match (header("streamtype").as_deref(), header("port").and_then(|p| p.parse::<u16>().ok())) {
                    (Some("error"), _) => pair.error = Some(id),
                    (Some("data"), Some(port)) => pair.data = Some((id, port)),
                    (kind, port) => {
                        tracing::debug!(?kind, ?port, "port-forward: a stream that is neither error nor data with a port");
                        continue;
                    }
                }
                if let Pair { error: Some(error), data: Some((data, port)) } = *pair {
                    pairs.remove(&request);
                    let (tx, rx) = mpsc::channel(64);
                    inbound.insert(data, tx);
                    tokio::spawn(forward(error, data, port, rx, out.clone(), dial.clone()));
                }
            }
            Frame::Data { id, fin, data } => {
                if let Some(tx) = inbound.get(&id) {
                    if !data.is_empty() && tx.send(Some(data)).await.is_err() {
                        inbound.remove(&id);
                    } else if fin {
                        let _ = tx.send(None).await;
                        inbound.remove(&id);
                    }
                }
            }
            Frame::RstStream { id } => {
                inbound.remove(&id);
            }
            Frame::Ping { id } => {
                let _ = out.send(FrameWriter::ping(id)).await;
            }
            Frame::GoAway => break Ok(()),
            Frame::Ignored => {}
        }
    };
    drop(inbound);
    drop(out);
    let _ = writing.await;
    result
}

/// One forwarded connection: dial the pod's port, then copy both ways; the data stream ends
/// (FIN) when the pod's side does, and the error stream with it, carrying the dial's failure.
async fn forward(error: u32, data: u32, port: u16, mut inbound: mpsc::Receiver<Option<Vec<u8>>>, out: mpsc::Sender<Vec<u8>>, dial: std::sync::Arc<Dial>) {
    let pod = match dial(port).await {
        Ok(s) => s,
        Err(why) => {
            let _ = out.send(FrameWriter::data(error, false, why.as_bytes())).await;
            let _ = out.send(FrameWriter::data(error, true, &[])).await;
            let _ = out.send(FrameWriter::data(data, true, &[])).await;
            return;
        }
    };
    let (mut from_pod, mut to_pod) = pod.into_split();
    let upstream = tokio::spawn(async move {
        while let Some(Some(bytes)) = inbound.recv().await {
            if to_pod.write_all(&bytes).await.is_err() {
                return;
            }
        }
        // The client finished sending (or went away): the pod reads EOF.
        let _ = to_pod.shutdown().await;
    });
    let mut buf = vec![0u8; CHUNK];
    loop {
        match from_pod.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if out.send(FrameWriter::data(data, false, &buf[..n])).await.is_err() {
                    upstream.abort();
                    return;
                }
            }
        }
    }
    let _ = out.send(FrameWriter::data(data, true, &[])).await;
    let _ = out.send(FrameWriter::data(error, true, &[])).await;
    let _ = upstream.await;
}

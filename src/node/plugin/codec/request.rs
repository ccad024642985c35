//! GetPreferredAllocation's and Allocate's requests, decoded without a heap
//! string per ID and within bounds.
//!
//! The kubelet lists every free device ID in GetPreferredAllocation (160,000
//! for two 80 GB GPUs at 1 MiB units); the generated type would allocate a
//! `String` for each before the handler runs. The server takes these types
//! instead (see `build.rs`): each repeated ID field is one byte buffer plus
//! offsets. IDs are compared as bytes, so no UTF-8 check is needed either.
//!
//! Bounds: beyond [`MAX_CONTAINERS`] container requests, or [`max_ids`] IDs
//! in one list, the rest of the field is skipped, not decoded, and the
//! handler refuses the request with [`Oversize`]. A generated
//! `AllocateRequest` of tiny container requests would cost about 24 heap
//! bytes per 2 wire bytes before any handler could count them.

use prost::DecodeError;
use prost::bytes::{Buf, BufMut};
use prost::encoding::{
    DecodeContext, WireType, check_wire_type, decode_varint, encode_key, encode_varint,
    encoded_len_varint, int32, key_len, message, skip_field,
};

/// Container requests accepted in one Allocate or GetPreferredAllocation.
/// The kubelet sends exactly one; a few more leave room for a client that
/// batches a small pod, and bound what one RPC can make the plugin decode,
/// log and answer.
pub const MAX_CONTAINERS: usize = 16;

/// No resource lists more devices than fit in the kubelet's 4 MiB message,
/// each at least a one-character ID and its health; no kubelet request
/// names more IDs in one list.
pub(crate) fn max_ids() -> usize {
    crate::rules::device::KUBELET_MAX_MESSAGE_BYTES
        / crate::rules::device::device_entry_len(1, "Healthy", None)
}

/// A request over a bound; nothing past the bound was decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Oversize {
    #[error(
        "{0} container requests in one RPC; at most {MAX_CONTAINERS} are accepted (the kubelet \
         sends one)"
    )]
    Containers(usize),
    #[error("a container request lists more than {0} device IDs, more than any resource has")]
    Ids(usize),
}

/// prost offers hand-written decoders no other way to build its error.
#[allow(deprecated)]
fn error(what: &'static str) -> DecodeError {
    DecodeError::new(what)
}

/// A `repeated string` field held as one buffer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IdList {
    bytes: Vec<u8>,
    ends: Vec<u32>,
    /// IDs past [`max_ids`] were skipped.
    over: bool,
}

impl IdList {
    pub fn iter(&self) -> impl ExactSizeIterator<Item = &[u8]> + '_ {
        (0..self.ends.len()).map(|i| {
            let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
            &self.bytes[start..self.ends[i] as usize]
        })
    }
}

/// One field of a hand-decoded message, under the tag its message gives it.
trait Field {
    fn merge(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError>;
    fn encode(&self, tag: u32, buf: &mut impl BufMut);
    fn encoded_len(&self, tag: u32) -> usize;
}

/// `prost::Message` for a struct of [`Field`]s, each under its tag; other
/// tags are skipped.
macro_rules! message {
    ($name:ty { $($tag:literal => $field:ident),+ }) => {
        impl prost::Message for $name {
            fn encode_raw(&self, buf: &mut impl BufMut) {
                $(Field::encode(&self.$field, $tag, buf);)+
            }

            fn merge_field(
                &mut self,
                tag: u32,
                wire_type: WireType,
                buf: &mut impl Buf,
                ctx: DecodeContext,
            ) -> Result<(), DecodeError> {
                match tag {
                    $($tag => Field::merge(&mut self.$field, tag, wire_type, buf, ctx),)+
                    _ => skip_field(wire_type, tag, buf, ctx),
                }
            }

            fn encoded_len(&self) -> usize {
                0 $(+ Field::encoded_len(&self.$field, $tag))+
            }

            fn clear(&mut self) {
                *self = Self::default();
            }
        }
    };
}

/// A proto3 `int32`: zero is not sent.
impl Field for i32 {
    fn merge(
        &mut self,
        _tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        int32::merge(wire_type, self, buf, ctx)
    }

    fn encode(&self, tag: u32, buf: &mut impl BufMut) {
        if *self != 0 {
            int32::encode(tag, self, buf);
        }
    }

    fn encoded_len(&self, tag: u32) -> usize {
        if *self != 0 {
            int32::encoded_len(tag, self)
        } else {
            0
        }
    }
}

impl Field for IdList {
    fn merge(
        &mut self,
        _tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        _ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        check_wire_type(WireType::LengthDelimited, wire_type)?;
        let len = usize::try_from(decode_varint(buf)?)
            .map_err(|_| error("device ID length overflows"))?;
        if len > buf.remaining() {
            return Err(error("buffer underflow"));
        }
        if self.ends.len() >= max_ids() {
            self.over = true;
            buf.advance(len);
            return Ok(());
        }
        let start = self.bytes.len();
        self.bytes.resize(start + len, 0);
        buf.copy_to_slice(&mut self.bytes[start..]);
        let end = u32::try_from(self.bytes.len()).map_err(|_| error("request over 4 GiB"))?;
        self.ends.push(end);
        Ok(())
    }

    fn encode(&self, tag: u32, buf: &mut impl BufMut) {
        for id in self.iter() {
            encode_key(tag, WireType::LengthDelimited, buf);
            encode_varint(id.len() as u64, buf);
            buf.put_slice(id);
        }
    }

    fn encoded_len(&self, tag: u32) -> usize {
        self.iter()
            .map(|id| key_len(tag) + encoded_len_varint(id.len() as u64) + id.len())
            .sum()
    }
}

impl<'a> FromIterator<&'a str> for IdList {
    fn from_iter<I: IntoIterator<Item = &'a str>>(iter: I) -> Self {
        let mut list = IdList::default();
        for id in iter {
            list.bytes.extend_from_slice(id.as_bytes());
            list.ends.push(list.bytes.len() as u32);
        }
        list
    }
}

/// `ContainerPreferredAllocationRequest`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerPreferred {
    pub available: IdList,
    pub(crate) must_include: IdList,
    pub(crate) size: i32,
}

message!(ContainerPreferred { 1 => available, 2 => must_include, 3 => size });

/// A container request whose ID lists may have gone past [`max_ids`].
pub trait IdLists {
    /// Whether a list skipped IDs past the bound.
    fn over(&self) -> bool;
}

impl IdLists for ContainerPreferred {
    fn over(&self) -> bool {
        self.available.over || self.must_include.over
    }
}

/// `ContainerAllocateRequest`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ContainerIds {
    pub(crate) ids: IdList,
}

impl IdLists for ContainerIds {
    fn over(&self) -> bool {
        self.ids.over
    }
}

message!(ContainerIds { 1 => ids });

/// A request's `repeated` container field (number 1), decoded up to
/// [`MAX_CONTAINERS`]; the rest is skipped and only counted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Containers<T> {
    items: Vec<T>,
    skipped: usize,
}

impl<T: prost::Message + Default + IdLists> Containers<T> {
    /// The container requests, or why the request is refused.
    pub fn checked(&self) -> Result<&[T], Oversize> {
        if self.skipped > 0 {
            return Err(Oversize::Containers(self.items.len() + self.skipped));
        }
        if self.items.iter().any(T::over) {
            return Err(Oversize::Ids(max_ids()));
        }
        Ok(&self.items)
    }
}

impl<T: prost::Message + Default> Field for Containers<T> {
    fn merge(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        if self.items.len() < MAX_CONTAINERS {
            message::merge_repeated(wire_type, &mut self.items, buf, ctx)
        } else {
            self.skipped += 1;
            skip_field(wire_type, tag, buf, ctx)
        }
    }

    fn encode(&self, tag: u32, buf: &mut impl BufMut) {
        for c in &self.items {
            message::encode(tag, c, buf);
        }
    }

    fn encoded_len(&self, tag: u32) -> usize {
        message::encoded_len_repeated(tag, &self.items)
    }
}

impl<T> From<Vec<T>> for Containers<T> {
    fn from(items: Vec<T>) -> Self {
        Containers { items, skipped: 0 }
    }
}

/// A request of one [`Containers`] field, as both RPCs' requests are.
macro_rules! containers_request {
    ($(#[$doc:meta])* $vis:vis $name:ident, $item:ty) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Default, PartialEq, Eq)]
        $vis struct $name {
            $vis containers: Containers<$item>,
        }

        message!($name { 1 => containers });
    };
}

containers_request!(
    /// `PreferredAllocationRequest`.
    pub PreferredRequest,
    ContainerPreferred
);
containers_request!(
    /// `AllocateRequest`.
    pub(crate) AllocateIdsRequest,
    ContainerIds
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api;
    use prost::Message;

    #[test]
    fn decodes_what_the_generated_type_encodes_and_back() {
        let generated = api::PreferredAllocationRequest {
            container_requests: vec![
                api::ContainerPreferredAllocationRequest {
                    available_device_i_ds: vec![
                        "a0".into(),
                        "a1".into(),
                        "".into(),
                        "GPU-x".into(),
                    ],
                    must_include_device_i_ds: vec!["a1".into()],
                    allocation_size: 2,
                },
                api::ContainerPreferredAllocationRequest::default(),
            ],
        };
        let bytes = generated.encode_to_vec();
        let ours = PreferredRequest::decode(bytes.as_slice()).unwrap();
        let containers = ours.containers.checked().unwrap();
        assert_eq!(containers.len(), 2);
        let c = &containers[0];
        let ids: Vec<&[u8]> = c.available.iter().collect();
        assert_eq!(ids, vec![&b"a0"[..], b"a1", b"", b"GPU-x"]);
        assert_eq!(c.must_include.iter().collect::<Vec<_>>(), vec![&b"a1"[..]]);
        assert_eq!(c.size, 2);
        assert_eq!(ours.encode_to_vec(), bytes);
        assert_eq!(ours.encoded_len(), bytes.len());
    }

    #[test]
    fn truncated_input_is_an_error_not_a_panic() {
        let generated = api::PreferredAllocationRequest {
            container_requests: vec![api::ContainerPreferredAllocationRequest {
                available_device_i_ds: vec!["abcdef".into()],
                ..Default::default()
            }],
        };
        let bytes = generated.encode_to_vec();
        for cut in 1..bytes.len() {
            assert!(
                PreferredRequest::decode(&bytes[..cut]).is_err(),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn containers_past_the_bound_are_counted_not_decoded() {
        let one = api::ContainerAllocateRequest {
            devices_ids: vec!["a0".into()],
        };
        let bytes = api::AllocateRequest {
            container_requests: vec![one; MAX_CONTAINERS + 5],
        }
        .encode_to_vec();
        let ours = AllocateIdsRequest::decode(bytes.as_slice()).unwrap();
        assert_eq!(ours.containers.items.len(), MAX_CONTAINERS);
        assert_eq!(
            ours.containers.checked(),
            Err(Oversize::Containers(MAX_CONTAINERS + 5))
        );
        let bytes = api::AllocateRequest {
            container_requests: vec![api::ContainerAllocateRequest {
                devices_ids: vec![String::new(); max_ids() + 1],
            }],
        }
        .encode_to_vec();
        let ours = AllocateIdsRequest::decode(bytes.as_slice()).unwrap();
        assert_eq!(ours.containers.items[0].ids.iter().len(), max_ids());
        assert_eq!(ours.containers.checked(), Err(Oversize::Ids(max_ids())));
    }
}

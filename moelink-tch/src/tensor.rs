//! tch tensors as the core sees them: a [`TensorMeta`] for the checks of
//! `ep_core::calls` (what `moelink.checks.tensor_meta` is in Python), a raw
//! device address for the launches, and new tensors allocated through tch as
//! an [`OutputSpec`] says (what `moelink._buffer_common.empty` is).

use ep_core::calls::{DType, OutputSpec, TensorMeta, CPU, OTHER_DEVICE};
use tch::{Device, Kind, Tensor};

use crate::error::Result;

/// The core's dtype of a tch kind (torch's names: `Kind::Int` is int32).
pub fn dtype_of(kind: Kind) -> DType {
    match kind {
        Kind::Bool => DType::Bool,
        Kind::Uint8 => DType::U8,
        Kind::Int8 => DType::I8,
        Kind::Int16 => DType::I16,
        Kind::Int => DType::I32,
        Kind::Int64 => DType::I64,
        Kind::Half => DType::F16,
        Kind::BFloat16 => DType::BF16,
        Kind::Float => DType::F32,
        Kind::Double => DType::F64,
        Kind::Float8e4m3fn => DType::F8E4M3,
        Kind::Float8e5m2 => DType::F8E5M2,
        // Never accepted by a check; named as torch names them.
        Kind::ComplexHalf => DType::Other("complex32".into()),
        Kind::ComplexFloat => DType::Other("complex64".into()),
        Kind::ComplexDouble => DType::Other("complex128".into()),
        Kind::QInt8 => DType::Other("qint8".into()),
        Kind::QUInt8 => DType::Other("quint8".into()),
        Kind::QInt32 => DType::Other("qint32".into()),
        Kind::Float8e5m2fnuz => DType::Other("float8_e5m2fnuz".into()),
        Kind::Float8e4m3fnuz => DType::Other("float8_e4m3fnuz".into()),
    }
}

/// The tch kind of a dtype the core names (an output's); None for
/// [`DType::Other`].
pub fn kind_of(dtype: &DType) -> Option<Kind> {
    Some(match dtype {
        DType::Bool => Kind::Bool,
        DType::U8 => Kind::Uint8,
        DType::I8 => Kind::Int8,
        DType::I16 => Kind::Int16,
        DType::I32 => Kind::Int,
        DType::I64 => Kind::Int64,
        DType::F16 => Kind::Half,
        DType::BF16 => Kind::BFloat16,
        DType::F32 => Kind::Float,
        DType::F64 => Kind::Double,
        DType::F8E4M3 => Kind::Float8e4m3fn,
        DType::F8E5M2 => Kind::Float8e5m2,
        DType::Other(_) => return None,
    })
}

/// A tch device as the core's checks take it: a CUDA device's index,
/// [`CPU`], or [`OTHER_DEVICE`].
pub fn device_index(device: Device) -> i32 {
    match device {
        Device::Cuda(i) => i as i32,
        Device::Cpu => CPU,
        _ => OTHER_DEVICE,
    }
}

/// What the checks read of `t`: dtype, shape, strides (elements), device.
/// (An undefined tensor, which tch can hold, reads as an empty uint8 tensor
/// on no device: every check refuses it.)
pub fn meta(t: &Tensor) -> TensorMeta {
    if !t.defined() {
        return TensorMeta {
            dtype: DType::Other("undefined".into()),
            shape: vec![0],
            strides: vec![1],
            device: OTHER_DEVICE,
        };
    }
    TensorMeta {
        dtype: dtype_of(t.kind()),
        shape: t.size(),
        strides: t.stride(),
        device: device_index(t.device()),
    }
}

/// [`meta`] of an optional tensor.
pub fn opt_meta(t: Option<&Tensor>) -> Option<TensorMeta> {
    t.map(meta)
}

/// The device address of `t`; 0 for None or an empty tensor (what the core
/// takes for an absent tensor), as `moelink.checks.tensor_ptr`.
pub fn ptr(t: Option<&Tensor>) -> u64 {
    match t {
        Some(t) if t.numel() > 0 => t.data_ptr() as u64,
        _ => 0,
    }
}

/// A new tensor on `device` as `spec` says (dtype, shape, strides; zeroed
/// where it says so), allocated by tch (torch's caching allocator, on the
/// device's current stream).
pub fn empty(spec: &OutputSpec, device: Device) -> Result<Tensor> {
    let kind = kind_of(&spec.dtype).ok_or_else(|| {
        crate::Error::state(format!(
            "output {}: no tch kind for {}",
            spec.name, spec.dtype
        ))
    })?;
    let mut t = Tensor::f_empty_strided(&spec.shape, &spec.strides, (kind, device))?;
    if spec.zeroed {
        let _ = t.f_zero_()?;
    }
    Ok(t)
}

/// The output called `name` of a plan's `outputs`, allocated (None where the
/// plan has no such output: an optional one the call does not make).
pub fn output(outputs: &[OutputSpec], name: &str, device: Device) -> Result<Option<Tensor>> {
    ep_core::calls::output(outputs, name)
        .map(|s| empty(s, device))
        .transpose()
}

/// [`output`] of an output every plan of the call has.
pub fn required(outputs: &[OutputSpec], name: &str, device: Device) -> Result<Tensor> {
    output(outputs, name, device)?
        .ok_or_else(|| crate::Error::state(format!("the call's plan has no output {name}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_round_trip_through_the_core_dtypes() {
        for kind in [
            Kind::Bool,
            Kind::Uint8,
            Kind::Int8,
            Kind::Int16,
            Kind::Int,
            Kind::Int64,
            Kind::Half,
            Kind::BFloat16,
            Kind::Float,
            Kind::Double,
            Kind::Float8e4m3fn,
            Kind::Float8e5m2,
        ] {
            assert_eq!(kind_of(&dtype_of(kind)), Some(kind), "{kind:?}");
        }
        assert_eq!(dtype_of(Kind::ComplexFloat).to_string(), "torch.complex64");
        assert_eq!(kind_of(&dtype_of(Kind::ComplexFloat)), None);
    }

    #[test]
    fn meta_reads_shape_strides_and_device() {
        let t = Tensor::zeros([4, 6], (Kind::BFloat16, Device::Cpu));
        let m = meta(&t.tr());
        assert_eq!(m.dtype, DType::BF16);
        assert_eq!(
            (m.shape, m.strides, m.device),
            (vec![6, 4], vec![1, 6], CPU)
        );
        assert!(!meta(&t.tr()).is_contiguous());
        assert_eq!(ptr(None), 0);
        assert_eq!(
            ptr(Some(&Tensor::zeros([0, 3], (Kind::Float, Device::Cpu)))),
            0
        );
        assert_ne!(ptr(Some(&t)), 0);
    }

    #[test]
    fn outputs_are_allocated_as_specified() {
        let spec = OutputSpec {
            name: "s",
            dtype: DType::F32,
            shape: vec![3, 5],
            strides: vec![1, 3],
            zeroed: true,
        };
        let t = empty(&spec, Device::Cpu).unwrap();
        assert_eq!(
            (t.size(), t.stride(), t.kind()),
            (vec![3, 5], vec![1, 3], Kind::Float)
        );
        assert_eq!(t.abs().sum(Kind::Float).double_value(&[]), 0.0);
    }
}

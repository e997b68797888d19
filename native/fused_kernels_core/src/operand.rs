//! An op's tensor argument as the caller gave it: bytes on the host, or a buffer already on
//! a device. Ops stage operands where they run (upload for CUDA, download for the CPU) and
//! return results where the caller asked.

use crate::cuda::{DeviceTensor, Gpu};
use crate::dtype::{encode_f32, DType};
use crate::error::{arg_error, Result};
use crate::tensor::{HostTensor, OwnedTensor};
use std::ops::Deref;
use std::sync::Arc;

pub enum Operand<'a> {
    Host(HostTensor<'a>),
    Device(&'a DeviceTensor),
}

/// A device tensor borrowed from the caller or uploaded for this call.
pub enum Staged<'a> {
    Borrowed(&'a DeviceTensor),
    Owned(DeviceTensor),
}

impl Deref for Staged<'_> {
    type Target = DeviceTensor;
    fn deref(&self) -> &DeviceTensor {
        match self {
            Staged::Borrowed(t) => t,
            Staged::Owned(t) => t,
        }
    }
}

impl<'a> Operand<'a> {
    pub fn shape(&self) -> &[usize] {
        match self {
            Operand::Host(h) => &h.shape,
            Operand::Device(d) => &d.shape,
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            Operand::Host(h) => h.dtype,
            Operand::Device(d) => d.dtype,
        }
    }

    /// The operand on `gpu`, uploading host bytes.
    pub fn on_gpu(&self, name: &str, gpu: &Arc<Gpu>) -> Result<Staged<'a>> {
        match self {
            Operand::Host(h) => Ok(Staged::Owned(DeviceTensor::upload(gpu, h)?)),
            Operand::Device(d) => {
                d.check_device(name, gpu)?;
                Ok(Staged::Borrowed(d))
            }
        }
    }

    /// The operand's bytes on the host, downloading a device buffer.
    pub fn on_host(&self) -> Result<HostStaged<'_, 'a>> {
        match self {
            Operand::Host(h) => Ok(HostStaged::Borrowed(h)),
            Operand::Device(d) => Ok(HostStaged::Owned(d.download()?)),
        }
    }
}

/// A host tensor borrowed from the caller or downloaded for this call.
pub enum HostStaged<'b, 'a> {
    Borrowed(&'b HostTensor<'a>),
    Owned(OwnedTensor),
}

impl HostStaged<'_, '_> {
    pub fn view(&self) -> HostTensor<'_> {
        match self {
            HostStaged::Borrowed(h) => (*h).clone(),
            HostStaged::Owned(o) => o.view(),
        }
    }
}

/// Where a result goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    Host,
    Device,
}

/// A result on the host or on a device.
pub enum Value {
    Host(OwnedTensor),
    Device(DeviceTensor),
}

impl Value {
    pub fn from_device(t: DeviceTensor, placement: Placement) -> Result<Value> {
        match placement {
            Placement::Device => Ok(Value::Device(t)),
            Placement::Host => Ok(Value::Host(t.download()?)),
        }
    }
}

/// A parameter the kernels read as f32 (weights, the scan's A, D, delta_bias, initial state)
/// on the device: host values of any float type are converted; device buffers must already be
/// f32.
pub fn stage_f32<'a>(name: &str, op: &Operand<'a>, gpu: &Arc<Gpu>) -> Result<Staged<'a>> {
    match op {
        Operand::Host(h) if h.dtype != DType::F32 => {
            let bytes = encode_f32(&h.to_f32(), DType::F32);
            let host = HostTensor::new(name, &bytes, h.shape.clone(), DType::F32)?;
            Ok(Staged::Owned(DeviceTensor::upload(gpu, &host)?))
        }
        Operand::Device(d) if d.dtype != DType::F32 => Err(arg_error(format!(
            "{name}: device buffers for this parameter must be f32, got {}",
            d.dtype.name()
        ))),
        other => other.on_gpu(name, gpu),
    }
}

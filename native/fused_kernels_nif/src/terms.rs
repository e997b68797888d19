//! Terms <-> tensors. A host tensor crosses the boundary as `{binary, shape_tuple, type}`
//! with Nx's type tuples (`{:f, 32}`, `{:bf, 16}`, ...); a device tensor as a buffer resource.
//! Every decode failure names the argument and says what was expected.

use crate::atoms;
use fused_kernels_core::cuda::DeviceTensor;
use fused_kernels_core::error::{arg_error, Error, Result};
use fused_kernels_core::operand::{Operand, Placement, Value};
use fused_kernels_core::ops::Backend;
use fused_kernels_core::tensor::shape_from_i64;
use fused_kernels_core::{DType, HostTensor, OwnedTensor};
use rustler::types::tuple::{get_tuple, make_tuple};
use rustler::{Binary, Encoder, Env, NewBinary, ResourceArc, Term};

/// A device buffer owned by the BEAM; freed on the GPU when the last reference is collected.
pub struct Buffer(pub DeviceTensor);

#[rustler::resource_impl]
impl rustler::Resource for Buffer {}

/// `{:ok, value}` or `{:error, {kind, message}}`.
pub fn reply<'a>(env: Env<'a>, result: Result<Term<'a>>) -> Term<'a> {
    match result {
        Ok(t) => (atoms::ok(), t).encode(env),
        Err(e) => error_term(env, &e),
    }
}

pub fn error_term<'a>(env: Env<'a>, e: &Error) -> Term<'a> {
    let kind = rustler::Atom::from_str(env, e.kind()).unwrap_or_else(|_| atoms::error());
    (atoms::error(), (kind, e.to_string())).encode(env)
}

pub fn decode_dtype(name: &str, term: Term<'_>) -> Result<DType> {
    let bad = || {
        arg_error(format!(
            "{name}: type must be a tuple like {{:f, 32}}, {{:f, 16}} or {{:bf, 16}}"
        ))
    };
    let parts = get_tuple(term).map_err(|_| bad())?;
    if parts.len() != 2 {
        return Err(bad());
    }
    let kind = parts[0].atom_to_string().map_err(|_| bad())?;
    let bits: u64 = parts[1].decode().map_err(|_| bad())?;
    DType::from_nx(&kind, bits).map_err(|e| arg_error(format!("{name}: {e}")))
}

/// The elements of a proper list. rustler's own `Vec` decoder panics on an improper list
/// (`[2 | 2]`), so every list crossing the boundary is measured first: `enif_get_list_length`
/// refuses improper lists.
pub fn decode_list<'a>(name: &str, expected: &str, term: Term<'a>) -> Result<Vec<Term<'a>>> {
    let bad = || arg_error(format!("{name} must be a proper list of {expected}"));
    if !term.is_list() {
        return Err(bad());
    }
    term.list_length().map_err(|_| bad())?;
    term.decode::<Vec<Term<'a>>>().map_err(|_| bad())
}

pub fn decode_shape(name: &str, term: Term<'_>) -> Result<Vec<usize>> {
    let dims: Vec<Term> = match get_tuple(term) {
        Ok(dims) => dims,
        Err(_) => decode_list(name, "positive integers (a shape)", term).map_err(|_| {
            arg_error(format!(
                "{name}: shape must be a tuple of positive integers"
            ))
        })?,
    };
    let dims: Vec<i64> = dims
        .iter()
        .map(|d| d.decode::<i64>())
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| {
            arg_error(format!(
                "{name}: shape must be a tuple of positive integers"
            ))
        })?;
    shape_from_i64(name, &dims)
}

/// Decodes a host tensor triple; the binary is borrowed, never copied or cast.
pub fn decode_host<'a>(name: &str, term: Term<'a>) -> Result<HostTensor<'a>> {
    let bad = || {
        arg_error(format!(
            "{name}: expected {{binary, shape, type}} or a device buffer"
        ))
    };
    let parts = get_tuple(term).map_err(|_| bad())?;
    if parts.len() != 3 {
        return Err(bad());
    }
    let shape = decode_shape(name, parts[1])?;
    let dtype = decode_dtype(name, parts[2])?;
    let bin: Binary<'a> = parts[0]
        .decode()
        .map_err(|_| arg_error(format!("{name}: data must be a binary")))?;
    HostTensor::new(name, bin.as_slice(), shape, dtype)
}

/// A host triple or a device buffer resource.
pub fn decode_operand<'a>(name: &str, term: Term<'a>) -> Result<Operand<'a>> {
    if let Ok(buf) = term.decode::<ResourceArc<Buffer>>() {
        // The resource term keeps the buffer alive for the whole NIF call.
        let ptr: *const DeviceTensor = &buf.0;
        return Ok(Operand::Device(unsafe { &*ptr }));
    }
    decode_host(name, term).map(Operand::Host)
}

pub fn is_nil(term: Term<'_>) -> bool {
    term.decode::<rustler::Atom>()
        .is_ok_and(|a| a == atoms::nil())
}

/// An operand that may be absent (`nil`).
pub fn decode_optional_operand<'a>(name: &str, term: Term<'a>) -> Result<Option<Operand<'a>>> {
    if is_nil(term) {
        Ok(None)
    } else {
        decode_operand(name, term).map(Some)
    }
}

/// An atom option as a string, named in the error.
pub fn decode_atom(name: &str, term: Term<'_>) -> Result<String> {
    term.atom_to_string()
        .map_err(|_| arg_error(format!("{name} must be an atom")))
}

pub fn decode_device(term: Term<'_>) -> Result<Option<usize>> {
    if term
        .decode::<rustler::Atom>()
        .is_ok_and(|a| a == atoms::nil())
    {
        return Ok(None);
    }
    term.decode::<u32>()
        .map(|d| Some(d as usize))
        .map_err(|_| arg_error("device must be nil or a non-negative integer"))
}

pub fn decode_placement(term: Term<'_>) -> Result<Placement> {
    match term.decode::<rustler::Atom>() {
        Ok(a) if a == atoms::host() => Ok(Placement::Host),
        Ok(a) if a == atoms::device() => Ok(Placement::Device),
        _ => Err(arg_error("out must be :host or :device")),
    }
}

/// A number option (integers accepted), named in the error.
pub fn decode_f64(name: &str, term: Term<'_>) -> Result<f64> {
    term.decode::<f64>()
        .or_else(|_| term.decode::<i64>().map(|i| i as f64))
        .map_err(|_| arg_error(format!("{name} must be a number")))
}

pub fn decode_bool(name: &str, term: Term<'_>) -> Result<bool> {
    term.decode::<bool>()
        .map_err(|_| arg_error(format!("{name} must be true or false")))
}

pub fn encode_dtype<'a>(env: Env<'a>, dtype: DType) -> Result<Term<'a>> {
    let (kind, bits) = dtype.nx_parts();
    let kind = rustler::Atom::from_str(env, kind)
        .map_err(|_| Error::Argument("cannot encode type".into()))?;
    Ok((kind, bits).encode(env))
}

pub fn encode_shape<'a>(env: Env<'a>, shape: &[usize]) -> Term<'a> {
    let dims: Vec<Term> = shape.iter().map(|d| (*d as u64).encode(env)).collect();
    make_tuple(env, &dims)
}

pub fn encode_host<'a>(env: Env<'a>, t: &OwnedTensor) -> Result<Term<'a>> {
    let data = NewBinary::from_slice(env, &t.data);
    let data: Term<'a> = data.into();
    Ok(make_tuple(
        env,
        &[
            data,
            encode_shape(env, &t.shape),
            encode_dtype(env, t.dtype)?,
        ],
    ))
}

pub fn encode_value<'a>(env: Env<'a>, v: Value) -> Result<Term<'a>> {
    match v {
        Value::Host(t) => encode_host(env, &t),
        Value::Device(d) => Ok(ResourceArc::new(Buffer(d)).encode(env)),
    }
}

// ------------------------------------------------------------------ typed NIF arguments
//
// Every op NIF takes two arguments: a map of its tensors and a map of its options. Each map
// decodes once into a typed struct (`nif_map!`), field by field, and every failure names the
// field ("scale must be a number", "q: shape must be ..."). rustler's derived `NifMap`
// decoder would do the same walk but replaces the field decoder's message with "Could not
// decode field :x on %{}", and a NIF argument typed with it raises a bare `badarg`; callers
// here get `{:error, {:argument, message}}` instead.

/// A value decoded from one named argument or field, the name in every error.
pub trait FromTerm<'a>: Sized {
    /// What a list of these holds, for the error of a field that is not a proper list.
    const WHAT: &'static str = "values";

    fn from_term(name: &str, term: Term<'a>) -> Result<Self>;

    /// The value of a field the map does not hold: an error, except for `Option`s.
    fn absent(name: &str) -> Result<Self> {
        Err(arg_error(format!("{name} is missing")))
    }
}

impl<'a, T: FromTerm<'a>> FromTerm<'a> for Option<T> {
    fn from_term(name: &str, term: Term<'a>) -> Result<Self> {
        if is_nil(term) {
            Ok(None)
        } else {
            T::from_term(name, term).map(Some)
        }
    }

    fn absent(_name: &str) -> Result<Self> {
        Ok(None)
    }
}

impl<'a> FromTerm<'a> for bool {
    fn from_term(name: &str, term: Term<'a>) -> Result<Self> {
        decode_bool(name, term)
    }
}

impl<'a> FromTerm<'a> for f64 {
    fn from_term(name: &str, term: Term<'a>) -> Result<Self> {
        decode_f64(name, term)
    }
}

impl<'a> FromTerm<'a> for Operand<'a> {
    const WHAT: &'static str = "tensors";

    fn from_term(name: &str, term: Term<'a>) -> Result<Self> {
        decode_operand(name, term)
    }
}

/// A host tensor only (no device buffer).
impl<'a> FromTerm<'a> for HostTensor<'a> {
    fn from_term(name: &str, term: Term<'a>) -> Result<Self> {
        decode_host(name, term)
    }
}

/// A proper list, each element decoded under the list's name.
impl<'a, T: FromTerm<'a>> FromTerm<'a> for Vec<T> {
    const WHAT: &'static str = "lists";

    fn from_term(name: &str, term: Term<'a>) -> Result<Self> {
        decode_list(name, T::WHAT, term)?
            .into_iter()
            .map(|t| T::from_term(name, t))
            .collect()
    }
}

/// A field left undecoded, for a decoder that needs another field first (dense names its
/// operands after the kind in its options).
impl<'a> FromTerm<'a> for Term<'a> {
    fn from_term(_name: &str, term: Term<'a>) -> Result<Self> {
        Ok(term)
    }
}

/// A non-negative integer (a size).
impl<'a> FromTerm<'a> for usize {
    fn from_term(name: &str, term: Term<'a>) -> Result<Self> {
        term.decode::<u64>()
            .ok()
            .and_then(|v| usize::try_from(v).ok())
            .ok_or_else(|| arg_error(format!("{name} must be a non-negative integer")))
    }
}

/// A resource of this library's (an engine, prepared weights), or the caller's error.
pub fn resource<'a, T: rustler::Resource>(
    name: &str,
    term: Term<'a>,
    expected: &str,
) -> Result<ResourceArc<T>> {
    term.decode()
        .map_err(|_| arg_error(format!("{name}: expected {expected}")))
}

/// The options map of a call that takes none: `%{}` (a key is refused like a misspelt one).
pub struct NoOptions;

impl<'a> FromTerm<'a> for NoOptions {
    fn from_term(name: &str, term: Term<'a>) -> Result<Self> {
        static NONE: FieldAtoms = FieldAtoms::new();
        map_fields(name, &[], &NONE, term).map(|_| NoOptions)
    }
}

impl<'a> FromTerm<'a> for Placement {
    fn from_term(_name: &str, term: Term<'a>) -> Result<Self> {
        decode_placement(term)
    }
}

/// An atom option, by name (the op's own `parse` says which names it takes).
pub struct AtomName(pub String);

impl<'a> FromTerm<'a> for AtomName {
    fn from_term(name: &str, term: Term<'a>) -> Result<Self> {
        decode_atom(name, term).map(AtomName)
    }
}

/// A device ordinal (`nil`: the default device).
pub struct Device(pub Option<usize>);

impl<'a> FromTerm<'a> for Device {
    fn from_term(_name: &str, term: Term<'a>) -> Result<Self> {
        decode_device(term).map(Device)
    }

    fn absent(_name: &str) -> Result<Self> {
        Ok(Device(None))
    }
}

/// A shape: a tuple (or proper list) of positive integers.
pub struct Shape(pub Vec<usize>);

impl<'a> FromTerm<'a> for Shape {
    fn from_term(name: &str, term: Term<'a>) -> Result<Self> {
        decode_shape(name, term).map(Shape)
    }
}

/// Where an op runs and where its result goes: the `backend`, `device` and `out` fields every
/// op's options map carries.
pub fn target(backend: &AtomName, device: &Device) -> Result<Backend> {
    Backend::parse(&backend.0, device.0)
}

/// The atoms of a map's field names, made on the first call (`nif_map!` keeps one per struct),
/// so each key is matched by comparing atoms: no string is made per key and call.
pub struct FieldAtoms(std::sync::OnceLock<Vec<rustler::Atom>>);

impl FieldAtoms {
    pub const fn new() -> FieldAtoms {
        FieldAtoms(std::sync::OnceLock::new())
    }

    fn get(&self, env: Env<'_>, fields: &[&str]) -> Option<&[rustler::Atom]> {
        if let Some(atoms) = self.0.get() {
            return Some(atoms);
        }
        let atoms: Option<Vec<rustler::Atom>> = fields
            .iter()
            .map(|f| rustler::Atom::from_str(env, f).ok())
            .collect();
        atoms.map(|a| self.0.get_or_init(|| a).as_slice())
    }
}

/// The values of a map's atom keys in `fields` order (`None` where absent). Refuses a term
/// that is not a map, a key that is not an atom, and a key that is not a field (a misspelt
/// option is an error, not a silent default).
pub fn map_fields<'a>(
    name: &str,
    fields: &[&str],
    atoms: &FieldAtoms,
    term: Term<'a>,
) -> Result<Vec<Option<Term<'a>>>> {
    let known = || {
        if fields.is_empty() {
            "none".to_string()
        } else {
            fields.join(", ")
        }
    };
    let iter = rustler::types::map::MapIterator::new(term)
        .ok_or_else(|| arg_error(format!("{name} must be a map with the keys {}", known())))?;
    let atoms = atoms.get(term.get_env(), fields);
    let mut slots = vec![None; fields.len()];
    for (key, value) in iter {
        let not_atom = || arg_error(format!("{name}: keys must be atoms"));
        let atom = key.decode::<rustler::Atom>().map_err(|_| not_atom())?;
        let slot = match atoms {
            Some(atoms) => atoms.iter().position(|a| *a == atom),
            // No atoms made (cannot happen for a field name): compare the text.
            None => {
                let text = key.atom_to_string().map_err(|_| not_atom())?;
                fields.iter().position(|f| *f == text)
            }
        };
        match slot {
            Some(i) => slots[i] = Some(value),
            None => {
                let key = key.atom_to_string().unwrap_or_default();
                return Err(arg_error(format!(
                    "{name}: unknown key :{key} (known: {})",
                    known()
                )));
            }
        }
    }
    Ok(slots)
}

/// A field's name in errors: its own, or `map.field` inside a nested map.
pub fn field_name<'n>(nested: bool, map: &str, field: &'n str) -> std::borrow::Cow<'n, str> {
    if nested {
        format!("{map}.{field}").into()
    } else {
        field.into()
    }
}

/// `FromTerm` for an option given as an atom and parsed by the type's own `parse`:
/// `atom_option!(Cell, ":lstm or :gru")` (a term that is no atom is refused with that list).
macro_rules! atom_option {
    ($ty:ty, $expected:literal) => {
        impl<'a> $crate::terms::FromTerm<'a> for $ty {
            fn from_term(
                name: &str,
                term: rustler::Term<'a>,
            ) -> fused_kernels_core::error::Result<Self> {
                let atom = term.atom_to_string().map_err(|_| {
                    fused_kernels_core::error::arg_error(format!(
                        concat!("{} must be ", $expected),
                        name
                    ))
                })?;
                <$ty>::parse(&atom)
            }
        }
    };
}
pub(crate) use atom_option;

/// One field of a map decoded by `nif_map!`.
pub fn field<'a, T: FromTerm<'a>>(name: &str, slot: Option<Term<'a>>) -> Result<T> {
    match slot {
        Some(term) => T::from_term(name, term),
        None => T::absent(name),
    }
}

/// A struct decoded from a map with one atom key per field, and its `FromTerm`: the struct
/// written once, inside the macro (`nif_map! { struct Options { scale: f64, causal: bool } }`,
/// lifetimes, attributes and visibility as usual). For a struct defined elsewhere, its fields
/// by name: `nif_map!(Spec { kind, embed })`. `nested` before either names each field under the
/// map's own name in errors (`spec.embed must be ...`), for a map inside an argument.
macro_rules! nif_map {
    (nested $name:ident { $($field:ident),* $(,)? }) => {
        $crate::terms::nif_map!(@from_term true, $name { $($field),* });
    };
    ($name:ident $(<$l:lifetime>)? { $($field:ident),* $(,)? }) => {
        $crate::terms::nif_map!(@from_term false, $name $(<$l>)? { $($field),* });
    };
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident $(<$l:lifetime>)? {
            $($(#[$fmeta:meta])* $fvis:vis $field:ident: $ty:ty),* $(,)?
        }
    ) => {
        $(#[$meta])*
        $vis struct $name $(<$l>)? {
            $($(#[$fmeta])* $fvis $field: $ty),*
        }
        $crate::terms::nif_map!(@from_term false, $name $(<$l>)? { $($field),* });
    };
    (@from_term $nested:literal, $name:ident $(<$l:lifetime>)? { $($field:ident),* }) => {
        impl<'a> $crate::terms::FromTerm<'a> for $name $(<$l>)? {
            const WHAT: &'static str = "maps";

            fn from_term(
                name: &str,
                term: rustler::Term<'a>,
            ) -> fused_kernels_core::error::Result<Self> {
                const FIELDS: &[&str] = &[$(stringify!($field)),*];
                static ATOMS: $crate::terms::FieldAtoms = $crate::terms::FieldAtoms::new();
                let mut slots =
                    $crate::terms::map_fields(name, FIELDS, &ATOMS, term)?.into_iter();
                Ok($name {
                    $($field: $crate::terms::field(
                        &$crate::terms::field_name($nested, name, stringify!($field)),
                        slots.next().flatten(),
                    )?,)*
                })
            }
        }
    };
}
pub(crate) use nif_map;

/// Decodes an op's `(inputs, options)` pair.
pub fn decode_args<'a, I: FromTerm<'a>, O: FromTerm<'a>>(
    inputs: Term<'a>,
    options: Term<'a>,
) -> Result<(I, O)> {
    Ok((
        I::from_term("inputs", inputs)?,
        O::from_term("options", options)?,
    ))
}

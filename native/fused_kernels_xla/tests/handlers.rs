//! The FFI boundary without a GPU: C layouts, registration, the metadata query, attribute
//! decoding, and every error path that must come back as an FFI error (never a panic).

mod support;

use fused_kernels_xla::ffi::{self, code};
use fused_kernels_xla::frame::{self, Attr};
use fused_kernels_xla::ops;
use std::mem::{offset_of, size_of};
use support::{api, f32s, take_error, AttrValue::*, Frame, Spec};

#[test]
fn layouts_match_the_c_header() {
    // Offsets as xla/ffi/api/c_api.h lays them out on a 64-bit target.
    assert_eq!(size_of::<ffi::ExtensionBase>(), 24);
    assert_eq!(size_of::<ffi::ApiVersion>(), 24);
    assert_eq!(ffi::ERROR_CREATE_ARGS_STRUCT_SIZE, 28);
    assert_eq!(size_of::<ffi::Buffer>(), 48);
    assert_eq!(offset_of!(ffi::Buffer, data), 24);
    assert_eq!(size_of::<ffi::Args>(), 40);
    assert_eq!(size_of::<ffi::Attrs>(), 48);
    assert_eq!(size_of::<ffi::Scalar>(), 16);
    assert_eq!(size_of::<ffi::Array>(), 24);
    assert_eq!(offset_of!(ffi::CallFrame, stage), 32);
    assert_eq!(offset_of!(ffi::CallFrame, attrs), 120);
    assert_eq!(ffi::CALL_FRAME_STRUCT_SIZE, 168);
    assert_eq!(offset_of!(ffi::HandlerRegisterArgs, bundle), 48);
    assert_eq!(ffi::HANDLER_REGISTER_ARGS_STRUCT_SIZE, 84);
    assert_eq!(ffi::METADATA_STRUCT_SIZE, 36);
    assert_eq!(size_of::<ffi::MetadataExtension>(), 32);
    assert_eq!(offset_of!(ffi::Api, error_create), 48);
    assert_eq!(offset_of!(ffi::Api, handler_register), 72);
    assert_eq!(offset_of!(ffi::Api, stream_get), 80);
    assert_eq!(offset_of!(ffi::Api, device_memory_allocate), 120);
    assert_eq!(offset_of!(ffi::Api, device_memory_free), 128);
}

#[test]
fn registration_table_names_every_target_once() {
    let names: Vec<&str> = fused_kernels_xla::TARGETS.iter().map(|t| t.0).collect();
    assert_eq!(
        names,
        [
            "fused_kernels_flash_attention",
            "fused_kernels_selective_scan",
            "fused_kernels_layer_norm",
            "fused_kernels_rms_norm",
            "fused_kernels_dense",
            "fused_kernels_mamba_block",
            "fused_kernels_lstm",
            "fused_kernels_gru",
        ]
    );
    // The exported symbol of each target is the spec of the same name.
    for ((name, _, traits, _), spec) in fused_kernels_xla::TARGETS.iter().zip(ops::ALL) {
        assert_eq!(*name, spec.name);
        assert_eq!(*traits, spec.traits);
    }
    let graphable: Vec<&str> = ops::ALL
        .iter()
        .filter(|s| s.traits & ffi::TRAIT_COMMAND_BUFFER_COMPATIBLE != 0)
        .map(|s| s.name)
        .collect();
    // Every target may be recorded into a CUDA graph: none takes XLA scratch (dense's norm
    // kinds return their row statistics, the RNNs and the Mamba block take a workspace).
    assert_eq!(graphable, names);
}

#[test]
fn register_hands_every_handler_to_xla() {
    let a = api();
    let refused = unsafe { fused_kernels_xla::fused_kernels_xla_register(&a, c"CUDA".as_ptr()) };
    assert_eq!(refused, 0);
    let got = support::REGISTERED.lock().unwrap().clone();
    for (name, handler, traits, initialize) in fused_kernels_xla::TARGETS {
        let entry = got
            .iter()
            .find(|e| e.0 == *name)
            .unwrap_or_else(|| panic!("{name} not registered"));
        assert_eq!(entry.1, "CUDA");
        let init = if *initialize { *handler as usize } else { 0 };
        assert_eq!(entry.2, init, "{name}: initialize stage");
        assert_eq!(entry.3, *handler as usize, "{name}: execute stage");
        assert_eq!(entry.4, *traits);
        let cname = std::ffi::CString::new(*name).unwrap();
        let asked = unsafe { fused_kernels_xla::fused_kernels_xla_initializes(cname.as_ptr()) };
        assert_eq!(asked, i32::from(*initialize), "{name}");
    }
    // XLA calls the initialize stage before every run, replays of a command buffer included:
    // only the targets with work there (the cuBLAS handle) take it; attention does not.
    let with_init: Vec<&str> = fused_kernels_xla::TARGETS
        .iter()
        .filter(|t| t.3)
        .map(|t| t.0)
        .collect();
    assert_eq!(
        with_init,
        [
            "fused_kernels_mamba_block",
            "fused_kernels_lstm",
            "fused_kernels_gru"
        ]
    );
    assert_eq!(
        unsafe { fused_kernels_xla::fused_kernels_xla_initializes(c"no_such_target".as_ptr()) },
        -1
    );
    assert_eq!(
        unsafe { fused_kernels_xla::fused_kernels_xla_initializes(std::ptr::null()) },
        -1
    );
    // No API: nothing registered, every target reported refused.
    let n = unsafe {
        fused_kernels_xla::fused_kernels_xla_register(std::ptr::null(), std::ptr::null())
    };
    assert_eq!(n as usize, fused_kernels_xla::TARGETS.len());
}

#[test]
fn handlers_answer_the_metadata_query() {
    let a = api();
    for (name, handler, traits, _) in fused_kernels_xla::TARGETS {
        let mut f = Frame::new(&a, ffi::STAGE_EXECUTE, &[], &[], &[]);
        let md = f.metadata_query(ffi::METADATA_STRUCT_SIZE + 8);
        let err = unsafe { handler(f.ptr()) };
        assert!(take_error(err).is_none(), "{name}");
        let md = unsafe { &*md };
        assert_eq!(
            (md.api_version.major_version, md.api_version.minor_version),
            (0, 1)
        );
        assert_eq!(md.traits, *traits, "{name}");
    }
    // A metadata struct too small to hold the traits is refused, not written past.
    let mut f = Frame::new(&a, ffi::STAGE_EXECUTE, &[], &[], &[]);
    f.metadata_query(ffi::METADATA_STRUCT_SIZE - 4);
    let e = take_error(unsafe { fused_kernels_xla::fused_kernels_gru(f.ptr()) }).unwrap();
    assert_eq!(e.code, code::INVALID_ARGUMENT);
    assert!(e.message.contains("XLA_FFI_Metadata"), "{}", e.message);
}

#[test]
fn other_stages_and_null_frames_do_nothing() {
    let a = api();
    for stage in [ffi::STAGE_INSTANTIATE, ffi::STAGE_PREPARE] {
        let mut f = Frame::new(&a, stage, &[f32s(&[1])], &[], &[]);
        assert!(take_error(unsafe { fused_kernels_xla::fused_kernels_gru(f.ptr()) }).is_none());
    }
    assert!(unsafe { fused_kernels_xla::fused_kernels_gru(std::ptr::null_mut()) }.is_null());
    // Initialize with nothing to preload (dense) touches no device.
    let mut f = Frame::new(&a, ffi::STAGE_INITIALIZE, &[f32s(&[1, 2, 3])], &[], &[]);
    assert!(take_error(unsafe { fused_kernels_xla::fused_kernels_dense(f.ptr()) }).is_none());
}

#[test]
fn attributes_decode_by_type() {
    let a = api();
    let f = Frame::new(
        &a,
        ffi::STAGE_EXECUTE,
        &[],
        &[],
        &[
            ("causal", Bool(true)),
            ("layers", I64(2)),
            ("layout", Str("bhsd")),
            ("scale", F32(0.125)),
            ("eps", F64(1e-6)),
            ("window", I64s(vec![-1, 0])),
        ],
    );
    let attrs = unsafe { frame::attrs(&f.frame.attrs) }.unwrap();
    assert_eq!(attrs.get("causal"), Some(&Attr::Bool(true)));
    assert_eq!(attrs.get("layers"), Some(&Attr::Int(2)));
    assert_eq!(attrs.get("layout"), Some(&Attr::Str("bhsd".into())));
    assert_eq!(attrs.get("scale"), Some(&Attr::Float(0.125)));
    assert_eq!(attrs.get("window"), Some(&Attr::Ints(vec![-1, 0])));
    assert!(attrs.bool_or("causal", false).unwrap());
    assert!(attrs.bool_or("absent", true).unwrap());
    assert_eq!(attrs.int_or("layers", 1).unwrap(), 2);
    assert_eq!(attrs.float_or("eps", 0.0).unwrap(), 1e-6);
    // An integer where a number is asked for is accepted; the other way round is not.
    assert_eq!(attrs.float_or("layers", 0.0).unwrap(), 2.0);
    let e = attrs.int_or("scale", 0).unwrap_err();
    assert!(
        e.to_string()
            .contains("attribute scale: expected an integer"),
        "{e}"
    );
    let e = attrs.str_or("causal", "").unwrap_err();
    assert!(e.to_string().contains("attribute causal"), "{e}");
    let e = attrs.only(&["causal"]).unwrap_err();
    assert!(e.to_string().contains("unknown"), "{e}");
}

fn call(
    handler: ffi::Handler,
    args: &[support::Spec],
    rets: &[support::Spec],
    attrs: &[(&'static str, support::AttrValue)],
) -> Option<support::FakeError> {
    let a = api();
    let mut f = Frame::new(&a, ffi::STAGE_EXECUTE, args, rets, attrs);
    take_error(unsafe { handler(f.ptr()) })
}

fn invalid(e: Option<support::FakeError>, needle: &str) {
    let e = e.expect("an error");
    assert_eq!(e.code, code::INVALID_ARGUMENT, "{}", e.message);
    assert!(
        e.message.contains(needle),
        "{:?} lacks {needle:?}",
        e.message
    );
}

#[test]
fn every_target_refuses_an_attribute_outside_its_list_first() {
    // The check runs before the operands are looked at: the attribute list is the target's
    // whole contract for options (the Elixir lowering's test reads these lists).
    for (name, handler, _, _) in fused_kernels_xla::TARGETS {
        let e = call(*handler, &[], &[], &[("bogus", Bool(true))]);
        invalid(e, "attribute bogus: unknown; this call takes ");
        let e = call(*handler, &[], &[], &[]).expect("an error");
        assert!(!e.message.contains("attribute"), "{name}: {}", e.message);
    }
}

#[test]
fn flash_attention_errors_name_what_to_fix() {
    let h = fused_kernels_xla::fused_kernels_flash_attention as ffi::Handler;
    let q = f32s(&[1, 60, 4, 64]);
    let lse = f32s(&[1, 4, 60]);
    invalid(
        call(h, &[q.clone(), q.clone()], &[q.clone(), lse.clone()], &[]),
        "fused_kernels_flash_attention: operands (q, k, v): expected 3 entries, got 2",
    );
    invalid(
        call(
            h,
            &[q.clone(), q.clone(), q.clone()],
            std::slice::from_ref(&q),
            &[],
        ),
        "results (out, lse)",
    );
    invalid(
        call(
            h,
            &[q.clone(), f32s(&[1, 60, 4, 32]), f32s(&[1, 60, 4, 32])],
            &[q.clone(), lse.clone()],
            &[],
        ),
        "k: head_dim 32 differs from q's head_dim 64",
    );
    invalid(
        call(
            h,
            &[q.clone(), q.clone(), q.clone()],
            &[q.clone(), lse.clone()],
            &[("layout", Str("sbhd"))],
        ),
        "layout must be :bshd or :bhsd",
    );
    invalid(
        call(
            h,
            &[q.clone(), q.clone(), q.clone()],
            &[q.clone(), lse.clone()],
            &[("causl", Bool(true))],
        ),
        "attribute causl: unknown",
    );
    invalid(
        call(
            h,
            &[q.clone(), q.clone(), q.clone()],
            &[q.clone(), f32s(&[1, 60, 4])],
            &[],
        ),
        "lse: must be f32 [1, 4, 60]",
    );
    invalid(
        call(
            h,
            &[q.clone(), q.clone(), q.clone()],
            &[q.clone(), lse.clone()],
            &[("window_left", I64(-3))],
        ),
        "window must be",
    );
    invalid(
        call(
            h,
            &vec![(ffi::dtype::S32, vec![1, 60, 4, 64]); 3],
            &[q.clone(), lse.clone()],
            &[],
        ),
        "operand 0: element type 4",
    );
}

#[test]
fn well_formed_calls_fail_cleanly_without_a_device() {
    // Past validation the handler looks for the device; with none (or with these made-up
    // addresses on a GPU machine) the answer is an FFI error, never a crash.
    let q = f32s(&[1, 60, 4, 64]);
    let e = call(
        fused_kernels_xla::fused_kernels_flash_attention,
        &[q.clone(), q.clone(), q.clone()],
        &[q.clone(), f32s(&[1, 4, 60])],
        &[("causal", Bool(true))],
    )
    .expect("an error");
    assert!(
        e.code == code::UNAVAILABLE || e.code == code::INVALID_ARGUMENT,
        "{} {}",
        e.code,
        e.message
    );
    assert!(
        e.message.starts_with("fused_kernels_flash_attention: "),
        "{}",
        e.message
    );
}

#[test]
fn optional_operands_are_named_and_checked() {
    let h = fused_kernels_xla::fused_kernels_selective_scan as ffi::Handler;
    let x = f32s(&[2, 61, 8]);
    let five = vec![
        x.clone(),
        x.clone(),
        f32s(&[8, 64]),
        f32s(&[2, 61, 64]),
        f32s(&[2, 61, 64]),
    ];
    let mut six = five.clone();
    six.push(f32s(&[8]));
    invalid(
        call(h, &six, std::slice::from_ref(&x), &[]),
        "operands: names 5 operand(s)",
    );
    invalid(
        call(
            h,
            &six,
            std::slice::from_ref(&x),
            &[("operands", Str("u,delta,a,b,c,q"))],
        ),
        "unknown operand \"q\"",
    );
    invalid(
        call(
            h,
            &six,
            std::slice::from_ref(&x),
            &[("operands", Str("u,delta,a,b,b,d"))],
        ),
        "\"b\" is named twice",
    );
    invalid(
        call(
            h,
            &five,
            std::slice::from_ref(&x),
            &[("operands", Str("u,delta,a,b,d"))],
        ),
        "\"c\" is required",
    );
    invalid(
        call(
            h,
            &five,
            std::slice::from_ref(&x),
            &[("dt_min", F64(0.001))],
        ),
        "dt_min, dt_max: give both",
    );
    invalid(
        call(h, &five, &[x.clone(), x.clone(), x.clone()], &[]),
        "results (out [, last_state])",
    );
    let h = fused_kernels_xla::fused_kernels_dense as ffi::Handler;
    invalid(
        call(
            h,
            &[f32s(&[4, 8]), f32s(&[8, 16])],
            &[f32s(&[4, 16])],
            &[("activation", Str("swish"))],
        ),
        "activation must be one of",
    );
    // The stats result: exactly for the norm-fused kinds, f32 {rows, 2}.
    invalid(
        call(
            h,
            &[f32s(&[4, 8]), f32s(&[8, 16])],
            &[f32s(&[4, 16]), f32s(&[4, 2])],
            &[],
        ),
        "results (out)",
    );
    invalid(
        call(
            h,
            &[f32s(&[4, 8]), f32s(&[8, 16]), f32s(&[8])],
            &[f32s(&[4, 16])],
            &[
                ("kind", Str("rms_norm_dense")),
                ("operands", Str("x,kernel,gamma")),
            ],
        ),
        "results (out, stats",
    );
    invalid(
        call(
            h,
            &[f32s(&[2, 3, 8]), f32s(&[8, 16]), f32s(&[8])],
            &[f32s(&[2, 3, 16]), f32s(&[3, 2])],
            &[
                ("kind", Str("rms_norm_dense")),
                ("operands", Str("x,kernel,gamma")),
            ],
        ),
        "stats: must be f32 {6, 2}",
    );
    invalid(
        call(
            h,
            &[f32s(&[4, 8]), f32s(&[8, 16])],
            &[f32s(&[4, 16]), f32s(&[4, 2]), f32s(&[4, 2])],
            &[("kind", Str("layer_norm_dense"))],
        ),
        "results (out, stats",
    );
    let h = fused_kernels_xla::fused_kernels_layer_norm as ffi::Handler;
    invalid(
        call(
            h,
            &[f32s(&[4, 8]), f32s(&[8]), f32s(&[8]), f32s(&[4, 8])],
            &[f32s(&[4, 8])],
            &[("operands", Str("x,gamma,beta,residual"))],
        ),
        "results (out [, sum with a residual]): expected 2 entries, got 1",
    );
    invalid(
        call(
            h,
            &[f32s(&[4, 8]), f32s(&[8]), f32s(&[8])],
            &[f32s(&[4, 8])],
            &[("eps", F64(-1.0))],
        ),
        "eps must be non-negative",
    );
}

#[test]
fn rnn_counts_follow_layers_and_state() {
    let h = fused_kernels_xla::fused_kernels_gru as ffi::Handler;
    let x = f32s(&[1, 60, 288]);
    // GRU, 2 layers, no initial state: x + 2 x (3 + 3 + 4) operands, sequence + 2 states +
    // the workspace.
    let args: Vec<_> = std::iter::once(x.clone())
        .chain((0..20).map(|_| f32s(&[256, 256])))
        .collect();
    invalid(
        call(
            h,
            &args[..20],
            &[x.clone(), x.clone(), x.clone(), x.clone()],
            &[("layers", I64(2))],
        ),
        "expected 21 entries, got 20",
    );
    invalid(
        call(
            h,
            &args,
            &[x.clone(), x.clone(), x.clone()],
            &[("layers", I64(2))],
        ),
        "results (sequence, then per layer its final state, then the workspace): expected 4 entries, got 3",
    );
    invalid(
        call(h, &args, std::slice::from_ref(&x), &[("layers", I64(0))]),
        "layers must be 1..64",
    );
    let h = fused_kernels_xla::fused_kernels_lstm as ffi::Handler;
    // LSTM, 1 layer with its (c, h): x + 4 + 4 + 4 + 2 operands, sequence + c + h + workspace.
    invalid(
        call(
            h,
            &args[..14],
            &[x.clone(), x.clone(), x.clone(), x.clone()],
            &[("initial_state", Bool(true))],
        ),
        "expected 15 entries, got 14",
    );
}

/// The C entry point's answer for `target` on `dims`.
fn words(target: &std::ffi::CStr, dims: &[i64]) -> i64 {
    unsafe {
        fused_kernels_xla::fused_kernels_xla_workspace_words(
            target.as_ptr(),
            dims.as_ptr(),
            dims.len(),
        )
    }
}

#[test]
fn workspace_sizes_follow_the_shapes() {
    // The users' GRU and LSTM (2 x 256, window 60, batch 1, x {1, 60, 288}) and the Mamba block
    // of the tests (batch 2, seq 61, hidden 64, inner 128, state 16, dt_rank 4). The Elixir
    // lowering's tests pin the same numbers.
    assert_eq!(
        words(c"fused_kernels_gru", &[4, 1, 60, 288, 256, 256]),
        3_030_976
    );
    assert_eq!(
        words(c"fused_kernels_lstm", &[4, 1, 60, 288, 256, 256]),
        3_681_216
    );
    assert_eq!(
        words(c"fused_kernels_gru", &[2, 1, 60, 288, 256, 256]),
        2_609_856
    );
    assert_eq!(
        words(c"fused_kernels_mamba_block", &[2, 61, 64, 128, 16, 4]),
        1_162_496
    );
    // Every buffer the recurrence may allocate fits: at least the f32 projection, the
    // sequence and the packed kernels of each layer, growing with batch, seq and units.
    let (b, t, f, h) = (8i64, 100, 200, 512);
    let gru = words(c"fused_kernels_gru", &[4, b, t, f, h]);
    assert!(
        gru >= b * t * 3 * h + b * t * h + f * 3 * h + h * 3 * h,
        "{gru}"
    );
    assert!(words(c"fused_kernels_gru", &[4, b, t + 1, f, h]) > gru);
    assert!(words(c"fused_kernels_gru", &[4, b + 1, t, f, h]) > gru);
    assert!(words(c"fused_kernels_gru", &[4, b, t, f, h, h]) > gru);
    assert!(words(c"fused_kernels_lstm", &[4, b, t, f, h]) > gru);
    // Bad requests: -1, never a panic.
    assert_eq!(words(c"fused_kernels_gru", &[3, 1, 60, 288, 256]), -1);
    assert_eq!(words(c"fused_kernels_gru", &[4, 1, 60, 288]), -1);
    assert_eq!(words(c"fused_kernels_gru", &[4, -1, 60, 288, 256]), -1);
    assert_eq!(
        words(c"fused_kernels_gru", &[4, i64::MAX, i64::MAX, 1, 256]),
        -1
    );
    assert_eq!(words(c"fused_kernels_mamba_block", &[2, 61, 64]), -1);
    assert_eq!(words(c"fused_kernels_dense", &[4, 8]), -1);
    assert_eq!(
        unsafe {
            fused_kernels_xla::fused_kernels_xla_workspace_words(
                std::ptr::null(),
                std::ptr::null(),
                0,
            )
        },
        -1
    );
}

#[test]
fn the_workspace_result_is_checked() {
    // GRU 1 x 16 units on x {1, 5, 8}: x + 3 + 3 + 4 operands; sequence, h, workspace.
    let h = fused_kernels_xla::fused_kernels_gru as ffi::Handler;
    let need = words(c"fused_kernels_gru", &[4, 1, 5, 8, 16]);
    let mut args = vec![f32s(&[1, 5, 8])];
    args.extend((0..3).map(|_| f32s(&[8, 16])));
    args.extend((0..3).map(|_| f32s(&[16, 16])));
    args.extend((0..4).map(|_| f32s(&[16])));
    let rets = |ws: Spec| vec![f32s(&[1, 5, 16]), f32s(&[1, 16]), ws];
    let msg = format!("workspace: must be f32 {{{need}}} (or longer) for this call");
    invalid(call(h, &args, &rets(f32s(&[need - 1])), &[]), &msg);
    invalid(call(h, &args, &rets(f32s(&[1, need])), &[]), &msg);
    invalid(
        call(h, &args, &rets((ffi::dtype::F16, vec![2 * need])), &[]),
        &msg,
    );
    // The right size (or more) passes validation: what comes back is about the device.
    for ws in [need, need + 100] {
        let e = call(h, &args, &rets(f32s(&[ws])), &[]);
        if let Some(e) = e {
            assert!(!e.message.contains("workspace"), "{}", e.message);
        }
    }
    // The Mamba block: out, then its workspace.
    let h = fused_kernels_xla::fused_kernels_mamba_block as ffi::Handler;
    let (b, t, hid, inner, n, r) = (2i64, 7, 8, 16, 4, 2);
    let margs = vec![
        f32s(&[b, t, hid]),
        f32s(&[hid]),
        f32s(&[hid]),
        f32s(&[hid, 2 * inner]),
        f32s(&[4, 1, inner]),
        f32s(&[inner, 2 * n]),
        f32s(&[inner, r]),
        f32s(&[r, inner]),
        f32s(&[inner, n]),
        f32s(&[inner, hid]),
    ];
    let need = words(c"fused_kernels_mamba_block", &[b, t, hid, inner, n, r]);
    invalid(
        call(h, &margs, &[f32s(&[b, t, hid])], &[]),
        "results (out, workspace): expected 2 entries, got 1",
    );
    invalid(
        call(h, &margs, &[f32s(&[b, t, hid]), f32s(&[need - 1])], &[]),
        &format!("workspace: must be f32 {{{need}}}"),
    );
    let mut wrong = margs.clone();
    wrong[3] = f32s(&[hid, 2 * inner + 2]);
    invalid(
        call(h, &wrong, &[f32s(&[b, t, hid]), f32s(&[need])], &[]),
        "in_kernel: 34 columns, expected 2 * inner = 32",
    );
}

#[test]
fn malformed_buffers_are_refused() {
    let a = api();
    let mut f = Frame::new(
        &a,
        ffi::STAGE_EXECUTE,
        &[f32s(&[2, 3])],
        &[f32s(&[2, 3])],
        &[],
    );
    // A negative dimension.
    unsafe {
        let b = *f.frame.args.args as *mut ffi::Buffer;
        *(*b).dims = -2;
    }
    let e = take_error(unsafe { fused_kernels_xla::fused_kernels_rms_norm(f.ptr()) }).unwrap();
    assert_eq!(e.code, code::INVALID_ARGUMENT);
    assert!(
        e.message.contains("operand 0: dimension -2"),
        "{}",
        e.message
    );
    // A frame older than the fields we read.
    let mut f = Frame::new(&a, ffi::STAGE_EXECUTE, &[], &[], &[]);
    f.frame.struct_size = 64;
    let e = take_error(unsafe { fused_kernels_xla::fused_kernels_rms_norm(f.ptr()) }).unwrap();
    assert!(
        e.message.contains("XLA_FFI_CallFrame of 64 bytes"),
        "{}",
        e.message
    );
}

#[test]
fn counters_count_execute_and_initialize_calls() {
    let read = || {
        let mut c = [0u64; 6];
        let n = unsafe { fused_kernels_xla::fused_kernels_xla_counters(c.as_mut_ptr(), c.len()) };
        assert_eq!(n, 6);
        c
    };
    // Other tests call handlers on other threads at the same time: compare with >=.
    let before = read();
    let h = fused_kernels_xla::fused_kernels_rms_norm as ffi::Handler;
    // An execute that fails validation still counts as one execute, none under capture.
    let e = call(h, &[f32s(&[4, 8])], &[f32s(&[4, 8])], &[]);
    invalid(e, "operands");
    let a = api();
    let mut f = Frame::new(&a, ffi::STAGE_INITIALIZE, &[f32s(&[1, 2, 3])], &[], &[]);
    let dense = fused_kernels_xla::fused_kernels_dense as ffi::Handler;
    assert!(take_error(unsafe { dense(f.ptr()) }).is_none());
    let after = read();
    assert!(after[0] > before[0], "executes {before:?} -> {after:?}");
    assert!(after[2] > before[2], "initializes {before:?} -> {after:?}");
    assert!(after[3] >= before[3] && after[4] >= before[4]);
    // The metadata query is not a call.
    let mut f = Frame::new(&a, ffi::STAGE_EXECUTE, &[], &[], &[]);
    f.metadata_query(ffi::METADATA_STRUCT_SIZE);
    assert!(take_error(unsafe { h(f.ptr()) }).is_none());
    // A null output pointer is refused without a write.
    assert_eq!(
        unsafe { fused_kernels_xla::fused_kernels_xla_counters(std::ptr::null_mut(), 5) },
        0
    );
    let mut two = [0u64; 2];
    assert_eq!(
        unsafe { fused_kernels_xla::fused_kernels_xla_counters(two.as_mut_ptr(), 2) },
        2
    );
}

if Code.ensure_loaded?(Nx) do
  defmodule FusedKernels.XLA do
    @moduledoc """
    Fused ops as XLA FFI custom calls inside EXLA-compiled graphs: no copies, no host round
    trip, the kernels run on XLA's own stream over XLA's buffers.

    When EXLA with `EXLA.CustomCall` (EXLA ≥ 0.12) is loaded and the handlers are registered
    (`load/1`), every op the handlers serve emits, inside `defn`, an `Nx.block/4` node whose struct is `FusedKernels.XLA.Block`: the
    fused Axon layers (`FusedKernels.Axon.Call`) and the top-level ops (`layer_norm/4`,
    `rms_norm/3`, `dense/4`, `swiglu/4`, `rms_norm_dense/4`, `layer_norm_dense/5`,
    `flash_attention/4` with or without lse, `selective_scan/6`, `mamba_block/3`, `lstm/3`,
    `gru/3` and the stacks). Our `EXLA.CustomCall` implementation lowers the block to a
    `stablehlo.custom_call` (typed FFI, `api_version = 4`, options in `backend_config`) on the
    CUDA platform and answers `:skip` on any other client, or when the operand or result types
    changed since the block was planned; EXLA then compiles the block's default body, the
    op's pure-Nx implementation. A call the handlers do not serve (f64; the mean-dt
    discretisation; a 1-D dense input; a Mamba block whose conv kernel is not Axon's
    `{k, 1, inner}`) emits no block and takes the op's next path: `Nx.runtime_call` for the
    Axon layers where available, else the pure-Nx implementation. Gradients are the pure-Nx
    implementation's, through `custom_grad` (the custom call has no derivative of its own).

    A custom call's result cannot share its operand's buffer unless the call declares the
    alias, and `EXLA.CustomCall.Spec` (0.13.1) has no field for it, so none is declared:
    inside a `while` loop that carries the attention's q, XLA copies each result into the
    carried buffer (one more launch per iteration; under JAX, with `input_output_aliases`,
    the same loop runs 1.5× faster).

    What has run: the blocks and the specs our implementation answers, compiled against
    EXLA's own `EXLA.CustomCall` sources (0.13.1), and the blocks' default bodies (values and
    gradients); the handlers under JAX on an H100. EXLA's NIF could not be built on our
    machines, so no EXLA-compiled graph has run a handler: EXLA's lowering of these specs,
    `load/1` and the handlers inside an EXLA graph are unverified.

    ## Loading the handlers into EXLA's process

    The handlers live in a separate shared library, `native/fused_kernels_xla`
    (`cargo build --release -p fused_kernels_xla` gives
    `target/release/libfused_kernels_xla.so`). EXLA loads extension libraries with
    `EXLA.NIF.load_dylib/1` (`dlopen` with `RTLD_NOW | RTLD_GLOBAL`, EXLA's main branch);
    when the library is loaded it finds XLA's FFI API in the process
    (`xla::ffi::GetXlaFfiApi()`, exported by EXLA's `libxla_extension.so`) and registers every
    target for the "CUDA" platform. `load/1` does this; call it once before compiling:

        FusedKernels.XLA.load("/path/to/libfused_kernels_xla.so")

    The library also exports `fused_kernels_xla_register(const XLA_FFI_Api*, const char*
    platform)` and each handler by its target name, for hosts that hand out the API pointer
    or register handlers themselves (JAX: `jax.ffi.register_ffi_target`).

    ## Call targets

    `fused_kernels_flash_attention`, `fused_kernels_gru`, `fused_kernels_lstm`,
    `fused_kernels_selective_scan`, `fused_kernels_mamba_block`, `fused_kernels_dense`,
    `fused_kernels_layer_norm`, `fused_kernels_rms_norm` (operands, results and attributes:
    `native/fused_kernels_xla/src/ops.rs`; each target's attribute names are its `OpSpec`'s
    `attributes`, which `test/xla_ops_test.exs` reads to check what this side emits).
    """

    @max_operands 128

    defmodule Block do
      @moduledoc """
      The `Nx.block/4` struct of a fused op lowered to an XLA FFI custom call: the target,
      its `backend_config` attributes (`{name, MLIR attribute}` pairs), the element type
      each operand is converted to, the types the results must have, and the results the
      handler writes after the op's own (`{shape, type}`s; none for most targets): the f32
      workspace of the LSTM, GRU and Mamba block handlers, which keep their temporaries
      there instead of borrowing XLA's scratch so that XLA may record them into a CUDA graph
      (a command buffer), and the row statistics of the norm-fused dense kinds.
      """
      @enforce_keys [:target]
      defstruct [:target, attributes: [], operand_types: [], result_types: [], extra: []]
    end

    @registered {__MODULE__, :registered}

    @doc """
    Whether the fused ops emit custom-call blocks here: Nx has `Nx.block/4`, our
    `EXLA.CustomCall` implementation was compiled (EXLA ≥ 0.12 compiled before this library:
    it is an optional dependency, list `:exla` in your deps), and the handlers are registered
    with this process's XLA (`load/1` or `registered/0`). Without the handlers a custom call
    would fail EXLA's compilation, so until then the ops take their other paths.
    """
    @spec available?() :: boolean
    def available? do
      :persistent_term.get(@registered, false) and function_exported?(Nx, :block, 4) and
        Code.ensure_loaded?(EXLA.CustomCall) and
        Code.ensure_loaded?(EXLA.CustomCall.FusedKernels.XLA.Block)
    end

    @doc """
    Declares the handlers registered with this process's XLA by other means than `load/1`
    (the host `dlopen`ed the library itself, or called `fused_kernels_xla_register` with its
    API pointer); with `false`, withdraws that, and the ops stop emitting custom calls.
    """
    @spec registered(boolean) :: :ok
    def registered(registered? \\ true) when is_boolean(registered?),
      do: :persistent_term.put(@registered, registered?)

    @doc """
    Loads the handler library into this process through EXLA (`EXLA.NIF.load_dylib/1`); the
    library registers its targets with XLA as it loads, and the ops emit custom calls from
    then on (`available?/0`).
    """
    @spec load(String.t()) :: :ok | {:error, term}
    def load(path) when is_binary(path) do
      cond do
        not File.exists?(path) ->
          {:error, "#{path} does not exist (cargo build --release -p fused_kernels_xla)"}

        Code.ensure_loaded?(EXLA.NIF) and function_exported?(EXLA.NIF, :load_dylib, 1) ->
          # apply/3: EXLA is an optional dependency.
          with :ok <- apply(EXLA.NIF, :load_dylib, [path]), do: registered(true)

        true ->
          {:error, "this EXLA has no EXLA.NIF.load_dylib/1 (EXLA's main branch has it)"}
      end
    end

    @doc """
    The output leaves of `op` on `inputs` as one `Nx.block/4` (a list of tensors in the
    order of `op.output_template/2`'s leaves), or `:skip` when `op` does not lower here.

    `FusedKernels.XLA.Lowering.describe/3` gives the call: the block, the operand tensors
    in the handler's order and how `inputs` are rebuilt from them (the default body sees
    only the block's operands).
    """
    @spec run(module, tuple, keyword) :: term
    def run(op, inputs, opts) do
      with {:ok, %Block{} = block, operands, rebuild} <-
             FusedKernels.XLA.Lowering.describe(op, inputs, opts),
           true <- length(operands) <= @max_operands || :skip do
        leaves = inputs |> op.output_template(opts) |> flatten()
        # The handler's own results (workspace, statistics) come after the op's; only the
        # handler writes them (the default body returns zeros, which nothing reads).
        extra = Enum.map(block.extra, fn {shape, type} -> Nx.template(shape, type) end)

        results = leaves ++ extra
        block = %{block | result_types: Enum.map(results, &Nx.type/1)}
        output = List.to_tuple(Enum.map(results, &Nx.template(Nx.shape(&1), Nx.type(&1))))

        default =
          arity_fun(length(operands), fn args ->
            own = args |> rebuild.() |> op.nx_call(opts) |> flatten()
            zeros = Enum.map(extra, &Nx.broadcast(Nx.tensor(0, type: Nx.type(&1)), &1))
            List.to_tuple(own ++ zeros)
          end)

        # apply/3: Nx < 0.12 has no Nx.block (this runs only when `available?/0`).
        apply(Nx, :block, [block, operands, output, default])
        |> Tuple.to_list()
        |> Enum.take(length(leaves))
      end
    end

    @doc """
    The `EXLA.CustomCall.call/4` answer for `block`: a spec on the CUDA platform when the
    operand and result types are the ones the block was planned for, else `:skip`.
    """
    @spec spec(struct, term, term, term) :: term
    def spec(%Block{} = block, out, args, client) do
      result_types = out |> flatten() |> Enum.map(& &1.type)

      cond do
        platform(client) != :cuda ->
          :skip

        length(args) != length(block.operand_types) ->
          :skip

        result_types != block.result_types ->
          :skip

        true ->
          # apply/3 keeps this module compilable without EXLA (an optional dependency).
          {:ok,
           struct(EXLA.CustomCall.Spec,
             call_target_name: block.target,
             attributes: block.attributes,
             operand_element_types: block.operand_types
           )}
      end
    end

    defp platform(%{platform: p}), do: p
    defp platform(_), do: nil

    # A fun of arity n + 1 (the block struct, then n operands) calling `f` with the operands
    # (`Nx.block/4` applies its default to the struct and each operand). A call with more
    # operands (an LSTM stack of over 9 layers with states) takes the op's next path.
    for n <- 1..@max_operands do
      args = Macro.generate_arguments(n, __MODULE__)

      defp arity_fun(unquote(n), f),
        do: fn _block, unquote_splicing(args) -> f.(unquote(args)) end
    end

    defp flatten(container), do: Nx.Defn.Composite.flatten_list([container])

    ## MLIR attribute text for `backend_config` (the typed FFI decodes these by type)

    @doc false
    @spec attr_bool(boolean) :: String.t()
    def attr_bool(b) when is_boolean(b), do: to_string(b)
    @doc false
    @spec attr_int(integer) :: String.t()
    def attr_int(i) when is_integer(i), do: "#{i} : i64"
    @doc false
    @spec attr_float(number) :: String.t()
    def attr_float(x) when is_number(x), do: "#{:erlang.float_to_binary(x / 1, [:short])} : f64"
    @doc false
    @spec attr_string(String.t()) :: String.t()
    def attr_string(s) when is_binary(s) do
      escaped = s |> String.replace("\\", "\\\\") |> String.replace("\"", "\\\"")
      "\"#{escaped}\""
    end

    @doc false
    # The kernels' element types.
    @spec served_type?(term) :: boolean
    def served_type?(type), do: type in [{:f, 32}, {:f, 16}, {:bf, 16}]
  end
end

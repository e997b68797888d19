defmodule FusedKernels.Dense do
  @moduledoc """
  Fused dense layers: `dense/4` (`act(x · kernel + bias) + residual`), `swiglu/4`
  (`silu(x · w_gate + bias_gate) * (x · w_up + bias_up)`), `rms_norm_dense/4` and
  `layer_norm_dense/5` (the norm over x's last axis applied while the GEMM loads x). One
  kernel each, one write of the output. Leading dimensions of x are flattened.

  Operands are Nx tensors, `FusedKernels.Buffer`s or `{binary, shape, type}` triples, all of
  x's type. With Nx tensors the result is an Nx tensor; otherwise a triple (or a buffer with
  `out: :device`). Native side: `native/fused_kernels_core/src/ops/dense/`,
  `kernels/dense.cu`; pure Nx: `FusedKernels.Nx.Dense`.

  ## Prepared kernels

  `prepare/3` converts a `dense/4` kernel and bias once for repeated calls and returns a value
  that `dense/4` takes in the kernel's place (`dense(x, prepared, activation: :gelu)`), with
  the same result as the plain kernel (within f32 rounding: the CPU product may sum in
  another order). On `:cpu` the kernel is packed into the CPU GEMM's layout once and held by
  the native library, as ONNX Runtime does when it loads a session; on `:cuda` and `:nx`, and
  for f64 kernels, the prepared value holds the tensors and a call runs as with them.

      prepared = FusedKernels.Dense.prepare(kernel, bias, backend: :cpu)
      y = FusedKernels.dense(x, prepared, activation: :gelu)
  """

  alias FusedKernels.{Backend, Buffer, Native, Options, Tensor}

  defmodule Prepared do
    @moduledoc """
    A dense kernel (and bias) prepared once by `FusedKernels.Dense.prepare/3`; pass it to
    `FusedKernels.dense/4` in the kernel's place. `ref` is the native packed handle (`:cpu`,
    f32/f16/bf16), else nil and the call runs on `kernel` and `bias`.
    """
    @enforce_keys [:backend, :kernel]
    defstruct [:backend, :device, :kernel, :bias, :ref]

    @type t :: %__MODULE__{
            backend: :cuda | :cpu | :nx,
            device: non_neg_integer | nil,
            kernel: FusedKernels.Tensor.t(),
            bias: FusedKernels.Tensor.t() | nil,
            ref: reference | nil
          }
  end

  @activations [:none, :relu, :gelu, :gelu_tanh, :silu, :sigmoid, :tanh]
  @slots [:x, :kernel, :kernel_up, :bias, :bias_up, :gamma, :beta, :residual]
  @common [backend: nil, device: nil, out: :host]

  @doc "See `FusedKernels.dense/4`."
  @spec dense(
          FusedKernels.Tensor.t(),
          FusedKernels.Tensor.t(),
          FusedKernels.Tensor.t() | nil | keyword,
          keyword
        ) :: FusedKernels.Tensor.nx() | FusedKernels.Tensor.result()
  def dense(x, kernel, bias \\ nil, opts \\ [])
  def dense(x, kernel, opts, []) when is_list(opts), do: dense(x, kernel, nil, opts)

  def dense(x, %Prepared{} = p, bias, opts) do
    if bias != nil,
      do:
        raise(
          ArgumentError,
          "bias: the prepared kernel holds its bias; give it to FusedKernels.Dense.prepare/3"
        )

    opts = options(opts, [activation: :none, residual: nil] ++ @common)

    case Keyword.get(opts, :backend) do
      b when b in [nil, :auto] or b == p.backend ->
        :ok

      b ->
        raise ArgumentError,
              "kernel: prepared for backend #{inspect(p.backend)}, the call asks for " <>
                "#{inspect(b)}; prepare it with backend: #{inspect(b)}"
    end

    cond do
      p.ref == nil ->
        opts = Keyword.put(opts, :backend, p.backend)
        opts = if p.device, do: Keyword.put_new(opts, :device, p.device), else: opts
        ops = %{x: x, kernel: p.kernel, bias: p.bias, residual: opts[:residual]}
        call(:dense, ops, opts)

      opts[:out] == :device ->
        raise ArgumentError, "out: the :cpu backend returns host tensors only"

      true ->
        dense_prepared(x, p.ref, opts)
    end
  end

  def dense(x, kernel, bias, opts) do
    opts = options(opts, [activation: :none, residual: nil] ++ @common)
    call(:dense, %{x: x, kernel: kernel, bias: bias, residual: opts[:residual]}, opts)
  end

  @doc "See `FusedKernels.swiglu/4`."
  @spec swiglu(FusedKernels.Tensor.t(), FusedKernels.Tensor.t(), FusedKernels.Tensor.t(), keyword) ::
          FusedKernels.Tensor.nx() | FusedKernels.Tensor.result()
  def swiglu(x, w_gate, w_up, opts \\ []) do
    opts = options(opts, [bias_gate: nil, bias_up: nil] ++ @common)

    ops = %{
      x: x,
      kernel: w_gate,
      kernel_up: w_up,
      bias: opts[:bias_gate],
      bias_up: opts[:bias_up]
    }

    call(:swiglu, ops, opts)
  end

  @doc "See `FusedKernels.rms_norm_dense/4`."
  @spec rms_norm_dense(
          FusedKernels.Tensor.t(),
          FusedKernels.Tensor.t(),
          FusedKernels.Tensor.t(),
          keyword
        ) :: FusedKernels.Tensor.nx() | FusedKernels.Tensor.result()
  def rms_norm_dense(x, norm_weight, kernel, opts \\ []) do
    opts = options(opts, [eps: 1.0e-6, bias: nil, activation: :none, residual: nil] ++ @common)

    ops = %{
      x: x,
      kernel: kernel,
      gamma: norm_weight,
      bias: opts[:bias],
      residual: opts[:residual]
    }

    call(:rms_norm_dense, ops, opts)
  end

  @doc "See `FusedKernels.layer_norm_dense/5`."
  @spec layer_norm_dense(
          FusedKernels.Tensor.t(),
          FusedKernels.Tensor.t(),
          FusedKernels.Tensor.t(),
          FusedKernels.Tensor.t(),
          keyword
        ) :: FusedKernels.Tensor.nx() | FusedKernels.Tensor.result()
  def layer_norm_dense(x, gamma, beta, kernel, opts \\ []) do
    opts = options(opts, [eps: 1.0e-5, bias: nil, activation: :none, residual: nil] ++ @common)
    ops = %{x: x, kernel: kernel, gamma: gamma, beta: beta, bias: opts[:bias]}
    call(:layer_norm_dense, Map.put(ops, :residual, opts[:residual]), opts)
  end

  @doc """
  Prepares a `dense/4` kernel `{k, n}` and optional bias `{n}` for repeated calls; see
  "Prepared kernels" above. The backend is chosen as for a call and a call with the prepared
  value runs there (one asking for another backend raises `ArgumentError`).

  ## Options

    * `:backend` - `:auto` (default), `:cpu`, `:cuda` or `:nx`.
    * `:device` - the CUDA device.
  """
  @spec prepare(FusedKernels.Tensor.t(), FusedKernels.Tensor.t() | nil | keyword, keyword) ::
          Prepared.t()
  def prepare(kernel, bias \\ nil, opts \\ [])
  def prepare(kernel, opts, []) when is_list(opts), do: prepare(kernel, nil, opts)

  def prepare(%Prepared{}, _bias, _opts),
    do: raise(ArgumentError, "kernel: already prepared")

  def prepare(kernel, bias, opts) do
    opts = Options.validate!(opts, [])

    for {name, t} <- [kernel: kernel, bias: bias],
        is_struct(t, Nx.Tensor),
        do: apply(Tensor, :check!, [to_string(name), t])

    backend = Backend.select(opts)

    ref =
      if backend == :cpu and native_type(kernel) != {:f, 64} do
        %{kernel: Tensor.to_native(kernel), bias: bias && Tensor.to_native(bias)}
        |> Native.dense_prepare(%{})
        |> Native.unwrap!()
      end

    %Prepared{
      backend: backend,
      device: Backend.device(opts),
      kernel: kernel,
      bias: bias,
      ref: ref
    }
  end

  defp native_type(%Buffer{type: type}), do: type
  defp native_type({_, _, type}), do: type
  defp native_type(t) when is_struct(t, Nx.Tensor), do: apply(Nx, :type, [t])
  defp native_type(t), do: Tensor.to_native(t)

  defp dense_prepared(x, ref, opts) do
    nx? = is_struct(x, Nx.Tensor) or is_struct(opts[:residual], Nx.Tensor)

    if nx? do
      for {name, t} <- [x: x, residual: opts[:residual]], is_struct(t, Nx.Tensor) do
        apply(Tensor, :check!, [to_string(name), t])

        if apply(Tensor, :symbolic?, [t]),
          do:
            raise(
              ArgumentError,
              "kernel: prepared for :cpu, which cannot run inside defn; prepare it with backend: :nx there"
            )
      end
    end

    residual = opts[:residual] && Tensor.to_native(opts[:residual])

    result =
      %{kernel: ref, x: Tensor.to_native(x), residual: residual}
      |> Native.dense_prepared(%{activation: opts[:activation]})
      |> Native.unwrap!()

    if nx?, do: apply(Tensor, :to_nx, [result]), else: result
  end

  defp options(opts, defaults) do
    schema =
      for {key, default} <- defaults,
          not Keyword.has_key?(Options.common(), key),
          do: {key, {default, check(key)}}

    Options.validate!(opts, schema)
  end

  defp check(:activation), do: {:in, @activations}
  defp check(:eps), do: :non_negative
  defp check(_tensor), do: :any

  defp call(kind, ops, opts) do
    nx? = Enum.any?(ops, fn {_, v} -> is_struct(v, Nx.Tensor) end)

    backend =
      cond do
        not nx? ->
          Backend.select_native(opts)

        true ->
          # Tensor.check!/2 exists only when Nx is loaded, as does this branch.
          for {name, v} <- ops,
              is_struct(v, Nx.Tensor),
              do: apply(Tensor, :check!, [to_string(name), v])

          symbolic? = Enum.any?(ops, fn {_, v} -> Tensor.symbolic?(v) end)
          Backend.select(opts, symbolic?)
      end

    if backend == :nx do
      # Inside defn: an XLA custom call where EXLA serves it (FusedKernels.XLA).
      with :skip <- in_graph(kind, ops, opts), do: nx(kind, ops, opts)
    else
      result = native(kind, ops, backend, opts)
      if nx? and opts[:out] == :host, do: apply(Tensor, :to_nx, [result]), else: result
    end
  end

  defp native(kind, ops, backend, opts) do
    operands =
      for {slot, t} <- Map.take(ops, @slots), t != nil, into: %{}, do: {slot, Tensor.to_native(t)}

    operands
    |> Native.dense(%{
      kind: kind,
      activation: Keyword.get(opts, :activation, :none),
      eps: Keyword.get(opts, :eps, 0.0) * 1.0,
      backend: backend,
      device: Backend.device(opts),
      out: opts[:out]
    })
    |> Native.unwrap!()
    |> Buffer.wrap()
  end

  if Code.ensure_loaded?(Nx) do
    @doc """
    The pure-Nx implementation (`FusedKernels.Nx.Dense`). `ops` holds the operand slots (`:x`,
    `:kernel`, `:kernel_up`, `:bias`, `:bias_up`, `:gamma`, `:beta`, `:residual`).
    """
    @spec nx(atom, map, keyword) :: FusedKernels.Tensor.nx()
    defdelegate nx(kind, ops, opts), to: FusedKernels.Nx.Dense

    defp in_graph(kind, ops, opts), do: FusedKernels.XLA.Ops.dense(kind, ops, opts)
  else
    defp in_graph(_kind, _ops, _opts), do: :skip

    @spec nx(atom, map, keyword) :: no_return
    def nx(_kind, _ops, _opts), do: raise(ArgumentError, "backend :nx needs Nx")
  end
end

defmodule FusedKernels.FlashAttention do
  @moduledoc """
  Attention forward, `softmax(scale * q k^T + mask) v`, with FlashAttention's conventions
  (layout, GQA/MQA, bottom-right causal, sliding window, lse). Native side:
  `native/fused_kernels_core/src/ops/flash_attention/` and `kernels/flash_attention.cu`; pure
  Nx: `FusedKernels.Nx.FlashAttention`.
  """

  alias FusedKernels.{Backend, Buffer, Native, Options, Tensor}

  @doc false
  @spec options(term) :: keyword
  def options(opts) do
    Options.validate!(opts,
      layout: {:bshd, {:in, [:bshd, :bhsd]}},
      causal: {false, :boolean},
      scale: {nil, {"nil or a number", &(is_nil(&1) or Options.number?(&1))}},
      window:
        {{-1, -1},
         {"{left, right} with integers >= -1 (-1: unbounded)",
          &match?({l, r} when is_integer(l) and is_integer(r) and l >= -1 and r >= -1, &1)}},
      return_lse: {false, :boolean}
    )
  end

  @doc """
  Runs on a native backend with no Nx involved: q, k, v are `{binary, shape, type}` triples
  or `FusedKernels.Buffer`s; returns a triple (or a buffer with `out: :device`), or
  `{out, lse}` with `return_lse: true`.
  """
  @spec native(FusedKernels.Tensor.t(), FusedKernels.Tensor.t(), FusedKernels.Tensor.t(), keyword) ::
          FusedKernels.Tensor.result()
          | {FusedKernels.Tensor.result(), FusedKernels.Tensor.result()}
  def native(q, k, v, opts \\ []) do
    opts = options(opts)
    call(Enum.map([q, k, v], &Tensor.to_native/1), Backend.select_native(opts), opts)
  end

  defp call([q, k, v], backend, opts) do
    scale = if opts[:scale], do: opts[:scale] * 1.0, else: nil

    %{q: q, k: k, v: v}
    |> Native.flash_attention(%{
      layout: opts[:layout],
      scale: scale,
      causal: opts[:causal],
      window: opts[:window],
      return_lse: opts[:return_lse],
      backend: backend,
      device: Backend.device(opts),
      out: opts[:out]
    })
    |> Native.unwrap!()
    |> wrap(opts[:return_lse])
  end

  defp wrap({out, lse}, true), do: {Buffer.wrap(out), Buffer.wrap(lse)}
  defp wrap(out, false), do: Buffer.wrap(out)

  if Code.ensure_loaded?(Nx) do
    # q {b, sq, h, d}, k and v {b, sk, kv_heads, d} (:bshd; :bhsd swaps seq and heads), with
    # h a multiple of kv_heads: the native geometry's rules, checked for :nx too.
    defp check_inputs!(q, k, v, layout) do
      Enum.each([{"q", q}, {"k", k}, {"v", v}], fn {n, t} -> Tensor.check!(n, t, rank: 4) end)
      {b, h, d} = parts(Nx.shape(q), layout)
      {_, kvh, _} = parts(Nx.shape(k), layout)
      k_shape = Nx.shape(k)

      Tensor.check!("k", k, shape: with_parts(layout, b, :_, kvh, d))
      Tensor.check!("v", v, shape: with_parts(layout, b, elem_seq(k_shape, layout), kvh, d))

      unless rem(h, kvh) == 0 do
        raise ArgumentError,
              "k: q's heads (#{h}) must be a multiple of k's heads (#{kvh}) for GQA/MQA"
      end
    end

    defp parts({b, _s, h, d}, :bshd), do: {b, h, d}
    defp parts({b, h, _s, d}, :bhsd), do: {b, h, d}
    defp elem_seq(shape, :bshd), do: elem(shape, 1)
    defp elem_seq(shape, :bhsd), do: elem(shape, 2)
    defp with_parts(:bshd, b, s, h, d), do: {b, s, h, d}
    defp with_parts(:bhsd, b, s, h, d), do: {b, h, s, d}

    @doc "See `FusedKernels.flash_attention/4`."
    @spec run(FusedKernels.Tensor.t(), FusedKernels.Tensor.t(), FusedKernels.Tensor.t(), keyword) ::
            FusedKernels.Tensor.nx() | FusedKernels.Tensor.result() | tuple
    def run(q, k, v, opts) do
      opts = options(opts)

      if Enum.any?([q, k, v], &match?(%Buffer{}, &1)) do
        native(q, k, v, opts)
      else
        [q, k, v] = Enum.map([q, k, v], &Nx.to_tensor/1)
        check_inputs!(q, k, v, opts[:layout])

        case Backend.select(opts, Enum.any?([q, k, v], &Tensor.symbolic?/1)) do
          :nx ->
            # Inside defn: an XLA custom call where EXLA serves it (FusedKernels.XLA).
            with :skip <- FusedKernels.XLA.Ops.flash_attention(q, k, v, opts),
                 do: nx(q, k, v, opts)

          backend ->
            result = call(Enum.map([q, k, v], &Tensor.to_native/1), backend, opts)

            cond do
              opts[:out] == :device -> result
              opts[:return_lse] -> {Tensor.to_nx(elem(result, 0)), Tensor.to_nx(elem(result, 1))}
              true -> Tensor.to_nx(result)
            end
        end
      end
    end

    @doc "The pure-Nx implementation: `FusedKernels.Nx.FlashAttention`."
    @spec nx(
            FusedKernels.Tensor.nx(),
            FusedKernels.Tensor.nx(),
            FusedKernels.Tensor.nx(),
            keyword
          ) :: FusedKernels.Tensor.nx() | {FusedKernels.Tensor.nx(), FusedKernels.Tensor.nx()}
    defdelegate nx(q, k, v, opts \\ []), to: FusedKernels.Nx.FlashAttention
  end
end

defmodule FusedKernels.FlashAttention do
  @moduledoc """
  Attention forward, `softmax(scale * q k^T + mask) v`, with FlashAttention's conventions
  (layout, GQA/MQA, bottom-right causal, sliding window, lse). Native side:
  `native/fused_kernels_core/src/ops/flash_attention.rs` and `kernels/flash_attention.cu`.
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

    @doc """
    The pure-Nx implementation (f32 arithmetic, f64 for f64 inputs; output in q's type);
    works on any Nx backend and inside `defn`.
    """
    @spec nx(
            FusedKernels.Tensor.nx(),
            FusedKernels.Tensor.nx(),
            FusedKernels.Tensor.nx(),
            keyword
          ) :: FusedKernels.Tensor.nx() | {FusedKernels.Tensor.nx(), FusedKernels.Tensor.nx()}
    def nx(q, k, v, opts \\ []) do
      layout = Keyword.get(opts, :layout, :bshd)
      causal = Keyword.get(opts, :causal, false)
      {left, right} = Keyword.get(opts, :window, {-1, -1})
      right = if causal, do: 0, else: right
      type = Nx.type(q)
      compute = if type == {:f, 64}, do: {:f, 64}, else: {:f, 32}

      to_bhsd = fn x ->
        x = Nx.as_type(x, compute)
        if layout == :bshd, do: Nx.transpose(x, axes: [0, 2, 1, 3]), else: x
      end

      check_shapes!(Nx.shape(q), Nx.shape(k), Nx.shape(v), layout, type, Nx.type(k), Nx.type(v))
      {q, k, v} = {to_bhsd.(q), to_bhsd.(k), to_bhsd.(v)}
      {b, h, sq, d} = Nx.shape(q)
      {_, kvh, sk, _} = Nx.shape(k)
      scale = Keyword.get(opts, :scale) || 1.0 / :math.sqrt(d)

      repeat = fn x ->
        if kvh == h,
          do: x,
          else:
            x
            |> Nx.new_axis(2)
            |> Nx.broadcast({b, kvh, div(h, kvh), sk, d})
            |> Nx.reshape({b, h, sk, d})
      end

      {k, v} = {repeat.(k), repeat.(v)}
      s = q |> Nx.dot([3], [0, 1], k, [3], [0, 1]) |> Nx.multiply(scale)

      # Key j is visible from query i around the bottom-right aligned diagonal i + sk - sq.
      diag = Nx.add(Nx.iota({sq, sk}, axis: 0), sk - sq)
      j = Nx.iota({sq, sk}, axis: 1)
      ok_left = if left < 0, do: 1, else: Nx.greater_equal(j, Nx.subtract(diag, left))
      ok_right = if right < 0, do: 1, else: Nx.less_equal(j, Nx.add(diag, right))
      mask = Nx.logical_and(ok_left, ok_right) |> Nx.broadcast({b, h, sq, sk})

      neg_inf = Nx.Constants.neg_infinity(compute)
      zero = Nx.tensor(0, type: compute)
      m = Nx.select(mask, s, neg_inf) |> Nx.reduce_max(axes: [3], keep_axes: true)
      # A fully masked row: max -inf; use 0 so exp stays finite; its sum is 0.
      empty = Nx.equal(m, neg_inf)
      m = Nx.select(empty, zero, m)
      e = Nx.select(mask, Nx.exp(Nx.subtract(s, m)), zero)
      z = Nx.sum(e, axes: [3], keep_axes: true)
      p = Nx.divide(e, Nx.select(Nx.equal(z, 0), Nx.tensor(1, type: compute), z))
      out = Nx.dot(p, [3], [0, 1], v, [2], [0, 1])
      out = if layout == :bshd, do: Nx.transpose(out, axes: [0, 2, 1, 3]), else: out
      out = Nx.as_type(out, type)

      if Keyword.get(opts, :return_lse, false) do
        lse =
          Nx.select(Nx.equal(z, 0), Nx.Constants.infinity(compute), Nx.add(m, Nx.log(z)))
          |> Nx.squeeze(axes: [3])
          |> Nx.as_type({:f, 32})

        {out, lse}
      else
        out
      end
    end

    defp check_shapes!(qs, ks, vs, layout, qt, kt, vt) do
      for {name, s} <- [q: qs, k: ks, v: vs], tuple_size(s) != 4 do
        raise ArgumentError,
              "#{name}: expected a 4-D tensor (layout #{inspect(layout)}), got shape #{inspect(s)}"
      end

      unless kt == qt and vt == qt,
        do:
          raise(
            ArgumentError,
            "k, v: must have q's type #{inspect(qt)}, got #{inspect({kt, vt})}"
          )

      unless ks == vs,
        do: raise(ArgumentError, "v: must have k's shape #{inspect(ks)}, got #{inspect(vs)}")

      pick = fn s ->
        if layout == :bshd,
          do: {elem(s, 0), elem(s, 2), elem(s, 3)},
          else: {elem(s, 0), elem(s, 1), elem(s, 3)}
      end

      {b, h, d} = pick.(qs)
      {kb, kvh, kd} = pick.(ks)
      if kb != b, do: raise(ArgumentError, "k: batch #{kb} differs from q's batch #{b}")
      if kd != d, do: raise(ArgumentError, "k: head_dim #{kd} differs from q's head_dim #{d}")

      if rem(h, kvh) != 0,
        do:
          raise(
            ArgumentError,
            "k: q's heads (#{h}) must be a multiple of k's heads (#{kvh}) for GQA/MQA"
          )

      if d > 256,
        do: raise(ArgumentError, "q: head_dim #{d} is over the supported maximum of 256")
    end
  end
end

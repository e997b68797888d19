if Code.ensure_loaded?(Nx) do
  defmodule FusedKernels.Nx.FlashAttention do
    @moduledoc """
    The pure-Nx implementation of `FusedKernels.FlashAttention` (f32 arithmetic, f64 for f64
    inputs; output in q's type); works on any Nx backend and inside `defn`.
    """

    @typep t :: FusedKernels.Tensor.nx()

    @doc """
    Attention with FlashAttention's conventions (see `FusedKernels.flash_attention/4`): `{out,
    lse}` with `return_lse: true`, else `out`.
    """
    @spec nx(t, t, t, keyword) :: t | {t, t}
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

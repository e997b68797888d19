if Code.ensure_loaded?(Nx) do
  defmodule FusedKernels.Nx.ScaledSoftmax do
    @moduledoc """
    The pure-Nx implementation of `FusedKernels.ScaledSoftmax` (f32 arithmetic, output in the
    input type); works on any Nx backend and inside `defn`.
    """

    @typep t :: FusedKernels.Tensor.nx()

    @doc "`softmax(scale * x)` over the last axis (see `FusedKernels.scaled_softmax/2`)."
    @spec nx(t, keyword) :: t
    def nx(x, opts \\ []) do
      scale = Keyword.get(opts, :scale, 1.0)
      causal = Keyword.get(opts, :causal, false)
      type = Nx.type(x)
      rank = Nx.rank(x)

      unless rank in [2, 4] do
        raise ArgumentError,
              "x: scaled_softmax takes a 2-D {rows, cols} or 4-D {batch, heads, seq_q, seq_k} tensor, got shape #{inspect(Nx.shape(x))}"
      end

      compute = if type == {:f, 64}, do: {:f, 64}, else: {:f, 32}
      s = x |> Nx.as_type(compute) |> Nx.multiply(scale)
      {sq, sk} = {elem(Nx.shape(x), rank - 2), elem(Nx.shape(x), rank - 1)}

      mask =
        if causal do
          # Bottom-right aligned: query row q keeps keys j <= q + sk - sq.
          Nx.greater_equal(
            Nx.add(Nx.iota({sq, sk}, axis: 0), sk - sq),
            Nx.iota({sq, sk}, axis: 1)
          )
          |> Nx.broadcast(Nx.shape(x))
        else
          Nx.broadcast(Nx.tensor(1, type: {:u, 8}), Nx.shape(x))
        end

      neg_inf = Nx.Constants.neg_infinity(compute)
      masked = Nx.select(mask, s, neg_inf)
      m = Nx.reduce_max(masked, axes: [-1], keep_axes: true)
      # A fully masked row has max -inf; use 0 so exp stays finite, and its sum is 0.
      m = Nx.select(Nx.equal(m, neg_inf), Nx.tensor(0, type: compute), m)
      e = Nx.select(mask, Nx.exp(Nx.subtract(s, m)), Nx.tensor(0, type: compute))
      z = Nx.sum(e, axes: [-1], keep_axes: true)
      safe_z = Nx.select(Nx.equal(z, 0), Nx.tensor(1, type: compute), z)

      e
      |> Nx.divide(safe_z)
      |> Nx.as_type(type)
    end
  end
end

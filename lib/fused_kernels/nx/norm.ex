if Code.ensure_loaded?(Nx) do
  defmodule FusedKernels.Nx.Norm do
    @moduledoc """
    The pure-Nx implementation of `FusedKernels.Norm` (f32 statistics, f64 for f64 inputs);
    works on any Nx backend and inside `defn`.
    """

    @typep t :: FusedKernels.Tensor.nx()

    @doc """
    LayerNorm or RMSNorm over the last axis (see `FusedKernels.layer_norm/4`); with
    `residual:`, `{normed, x + residual}`.
    """
    @spec nx(:layer_norm | :rms_norm, t, t, t | nil, keyword) :: t | {t, t}
    def nx(kind, x, weight, bias, opts \\ []) do
      type = Nx.type(x)
      compute = if type == {:f, 64}, do: {:f, 64}, else: {:f, 32}
      cols = elem(Nx.shape(x), Nx.rank(x) - 1)

      unless Nx.shape(weight) == {cols},
        do:
          raise(
            ArgumentError,
            "#{if kind == :layer_norm, do: "gamma", else: "weight"}: expected shape {#{cols}} (x's last axis), got #{inspect(Nx.shape(weight))}"
          )

      s = Nx.as_type(x, compute)
      s = if r = opts[:residual], do: Nx.add(s, Nx.as_type(r, compute)), else: s
      eps = Keyword.get(opts, :eps, 1.0e-5)

      centred =
        if kind == :layer_norm,
          do: Nx.subtract(s, Nx.mean(s, axes: [-1], keep_axes: true)),
          else: s

      var = Nx.mean(Nx.multiply(centred, centred), axes: [-1], keep_axes: true)

      y =
        centred
        |> Nx.multiply(Nx.rsqrt(Nx.add(var, eps)))
        |> Nx.multiply(Nx.as_type(weight, compute))

      y = if bias, do: Nx.add(y, Nx.as_type(bias, compute)), else: y
      y = Nx.as_type(y, type)
      if opts[:residual], do: {y, Nx.as_type(s, type)}, else: y
    end
  end
end

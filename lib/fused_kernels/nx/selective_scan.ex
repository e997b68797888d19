if Code.ensure_loaded?(Nx) do
  defmodule FusedKernels.Nx.SelectiveScan do
    @moduledoc """
    The pure-Nx implementation of `FusedKernels.SelectiveScan` (f32 arithmetic, f64 for f64
    inputs); works on any Nx backend and inside `defn`. The recurrence runs as a log-depth
    associative scan over the sequence.
    """

    @typep t :: FusedKernels.Tensor.nx()

    @max_state 256

    @doc """
    The scan (see `FusedKernels.selective_scan/6`): `{out, last_state}` with
    `return_last_state: true`, else `out`.
    """
    @spec nx(t, t, t, t, t, keyword) :: t | {t, t}
    def nx(u, delta, a, b, c, opts \\ []) do
      type = Nx.type(u)
      compute = if type == {:f, 64}, do: {:f, 64}, else: {:f, 32}
      {batch, seq, dim} = shape3!(u)
      n = state_size!(a, dim)
      cast = &Nx.as_type(&1, compute)

      dt = cast.(delta)
      dt = if bias = opts[:delta_bias], do: Nx.add(dt, cast.(bias)), else: dt

      dt =
        if opts[:delta_softplus],
          do: Nx.select(Nx.less_equal(dt, 20), Nx.log1p(Nx.exp(dt)), dt),
          else: dt

      dt = if clip = opts[:delta_clip], do: Nx.clip(dt, elem(clip, 0), elem(clip, 1)), else: dt
      uu = cast.(u)

      {bx, cx} =
        {per_channel(cast.(b), batch, seq, dim, n), per_channel(cast.(c), batch, seq, dim, n)}

      w =
        case opts[:b_discretization] || :per_channel do
          :per_channel -> dt
          :mean_dt -> Nx.broadcast(Nx.mean(dt, axes: [2], keep_axes: true), {batch, seq, dim})
        end

      decay = Nx.exp(Nx.multiply(Nx.new_axis(dt, 3), cast.(a)))
      input = Nx.multiply(Nx.new_axis(Nx.multiply(w, uu), 3), bx)

      input =
        if h0 = opts[:initial_state] do
          first = Nx.multiply(decay[[.., 0..0]], Nx.new_axis(cast.(h0), 1))
          Nx.put_slice(input, [0, 0, 0, 0], Nx.add(input[[.., 0..0]], first))
        else
          input
        end

      states = associative_scan(decay, input, seq)
      y = Nx.sum(Nx.multiply(states, cx), axes: [3])
      y = if d = opts[:d], do: Nx.add(y, Nx.multiply(cast.(d), uu)), else: y

      y =
        if z = opts[:z] do
          z = cast.(z)
          Nx.multiply(y, Nx.multiply(z, Nx.sigmoid(z)))
        else
          y
        end

      y = Nx.as_type(y, type)

      if opts[:return_last_state],
        do: {y, states[[.., seq - 1]] |> Nx.as_type({:f, 32})},
        else: y
    end

    # x_t = a_t * x_{t-1} + b_t as pairs combined over doubling offsets (Hillis-Steele):
    # (a, b) after (a', b') is (a * a', a * b' + b); shifted-in pairs are the identity (1, 0).
    defp associative_scan(a, b, seq, offset \\ 1)
    defp associative_scan(_a, b, seq, offset) when offset >= seq, do: b

    defp associative_scan(a, b, seq, offset) do
      shift = fn t, fill ->
        Nx.pad(t, fill, [{0, 0, 0}, {offset, -offset, 0}, {0, 0, 0}, {0, 0, 0}])
      end

      b = Nx.add(Nx.multiply(a, shift.(b, 0.0)), b)
      a = Nx.multiply(a, shift.(a, 1.0))
      associative_scan(a, b, seq, offset * 2)
    end

    defp per_channel(t, batch, seq, dim, n) do
      case Nx.shape(t) do
        {^batch, ^seq, ^n} ->
          t |> Nx.new_axis(2) |> Nx.broadcast({batch, seq, dim, n})

        {^batch, ^seq, g, ^n} when rem(dim, g) == 0 ->
          Nx.take(t, Nx.quotient(Nx.iota({dim}), div(dim, g)), axis: 2)

        other ->
          raise ArgumentError,
                "b: expected {#{batch}, #{seq}, #{n}} or {#{batch}, #{seq}, groups, #{n}}, got #{inspect(other)}"
      end
    end

    defp shape3!(u) do
      case Nx.shape(u) do
        {_, _, _} = s -> s
        s -> raise ArgumentError, "u: expected {batch, seq, channels}, got shape #{inspect(s)}"
      end
    end

    defp state_size!(a, dim) do
      case Nx.shape(a) do
        {^dim, n} when n <= @max_state ->
          n

        {^dim, n} ->
          raise ArgumentError,
                "a: state size #{n} is over the supported #{@max_state}; the scan never truncates state"

        s ->
          raise ArgumentError, "a: expected {#{dim}, state}, got #{inspect(s)}"
      end
    end
  end
end

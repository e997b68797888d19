defmodule FusedKernels.SelectiveScan do
  @moduledoc """
  Selective scan with mamba_ssm's semantics. Native side:
  `native/fused_kernels_core/src/ops/selective_scan.rs` and `kernels/selective_scan.cu`.
  """

  alias FusedKernels.{Backend, Buffer, Native, Options, Tensor}

  @doc false
  @spec options(term) :: keyword
  def options(opts) do
    Options.validate!(opts,
      d: {nil, :any},
      z: {nil, :any},
      delta_bias: {nil, :any},
      delta_softplus: {false, :boolean},
      initial_state: {nil, :any},
      return_last_state: {false, :boolean},
      b_discretization: {:per_channel, {:in, [:per_channel, :mean_dt]}}
    )
  end

  @doc """
  Runs natively with triples or `FusedKernels.Buffer`s (no Nx needed). Returns the output, or
  `{output, last_state}` with `return_last_state: true`.
  """
  @spec native(
          FusedKernels.Tensor.t(),
          FusedKernels.Tensor.t(),
          FusedKernels.Tensor.t(),
          FusedKernels.Tensor.t(),
          FusedKernels.Tensor.t(),
          keyword
        ) ::
          FusedKernels.Tensor.result()
          | {FusedKernels.Tensor.result(), FusedKernels.Tensor.result()}
  def native(u, delta, a, b, c, opts \\ []) do
    opts = options(opts)
    call([u, delta, a, b, c], Backend.select_native(opts), opts, & &1)
  end

  defp call(tensors, backend, opts, finish) do
    [u, delta, a, b, c] = Enum.map(tensors, &Tensor.to_native/1)
    opt = fn key -> if t = opts[key], do: Tensor.to_native(t), else: nil end

    %{
      u: u,
      delta: delta,
      a: a,
      b: b,
      c: c,
      d: opt.(:d),
      z: opt.(:z),
      delta_bias: opt.(:delta_bias),
      initial_state: opt.(:initial_state)
    }
    |> Native.selective_scan(%{
      delta_softplus: opts[:delta_softplus],
      b_discretization: opts[:b_discretization],
      return_last_state: opts[:return_last_state],
      backend: backend,
      device: Backend.device(opts),
      out: opts[:out]
    })
    |> Native.unwrap!()
    |> case do
      {y, last} when not is_binary(y) -> {finish.(Buffer.wrap(y)), finish.(Buffer.wrap(last))}
      y -> finish.(Buffer.wrap(y))
    end
  end

  if Code.ensure_loaded?(Nx) do
    @max_state 256

    @doc "See `FusedKernels.selective_scan/6`."
    @spec run(
            FusedKernels.Tensor.t(),
            FusedKernels.Tensor.t(),
            FusedKernels.Tensor.t(),
            FusedKernels.Tensor.t(),
            FusedKernels.Tensor.t(),
            keyword
          ) :: FusedKernels.Tensor.nx() | FusedKernels.Tensor.result() | tuple
    def run(u, delta, a, b, c, opts \\ []) do
      opts = options(opts)
      tensors = [u, delta, a, b, c]

      if Enum.all?(tensors, &match?(%Buffer{}, &1)) do
        native(u, delta, a, b, c, opts)
      else
        tensors = Enum.map(tensors, &to_tensor/1)
        optional = Enum.map([:d, :z, :delta_bias, :initial_state], &opts[&1])
        check_inputs!(tensors, opts)
        symbolic? = Enum.any?(tensors ++ optional, &Tensor.symbolic?/1)

        case Backend.select(opts, symbolic?) do
          :nx ->
            # Inside defn: an XLA custom call where EXLA serves it (FusedKernels.XLA).
            with :skip <- FusedKernels.XLA.Ops.selective_scan(tensors, opts),
                 do: apply(&nx/6, tensors ++ [opts])

          backend ->
            finish = if opts[:out] == :device, do: & &1, else: &Tensor.to_nx/1
            call(tensors, backend, opts, finish)
        end
      end
    end

    # mamba_ssm's shapes (the native geometry's rules), checked before any backend runs.
    defp check_inputs!([u, delta, a, b, c], opts) do
      if Enum.all?([u, delta, a, b, c], &is_struct(&1, Nx.Tensor)) do
        Tensor.check!("u", u, rank: 3)
        {nb, nl, nd} = Nx.shape(u)
        Tensor.check!("delta", delta, shape: {nb, nl, nd})
        Tensor.check!("a", a, shape: {nd, :_})
        n = elem(Nx.shape(a), 1)
        bc_shape = if Nx.rank(b) == 4, do: {nb, nl, :_, n}, else: {nb, nl, n}
        Tensor.check!("b", b, shape: bc_shape)
        Tensor.check!("c", c, shape: bc_shape)

        for {key, shape} <- [
              d: {nd},
              z: {nb, nl, nd},
              delta_bias: {nd},
              initial_state: {nb, nd, n}
            ],
            t = opts[key],
            is_struct(t, Nx.Tensor),
            do: Tensor.check!(Atom.to_string(key), t, shape: shape)
      end

      :ok
    end

    defp to_tensor(%Buffer{} = b), do: b
    defp to_tensor(t), do: Nx.to_tensor(t)

    @doc """
    The pure-Nx implementation (f32 arithmetic; works on any Nx backend and inside `defn`).
    The recurrence runs as a log-depth associative scan over the sequence.
    """
    @spec nx(
            FusedKernels.Tensor.nx(),
            FusedKernels.Tensor.nx(),
            FusedKernels.Tensor.nx(),
            FusedKernels.Tensor.nx(),
            FusedKernels.Tensor.nx(),
            keyword
          ) :: FusedKernels.Tensor.nx() | {FusedKernels.Tensor.nx(), FusedKernels.Tensor.nx()}
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

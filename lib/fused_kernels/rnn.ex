defmodule FusedKernels.Rnn do
  @moduledoc """
  LSTM and GRU with `Axon.lstm`/`Axon.gru`'s equations and parameter maps, so a trained Axon
  checkpoint drops in. Native side: `native/fused_kernels_core/src/ops/rnn/` and
  `kernels/rnn*.cu`; pure Nx: `FusedKernels.Nx.Rnn`.

  Params per layer: `%{"input_kernel" => %{gate => {in, units}}, "hidden_kernel" =>
  %{gate => {units, units}}, "bias" => %{name => {units}}}` with Axon's names (LSTM `wii wif
  wig wio` / `whi whf whg who` / `bi bf bg bo`; GRU `wir wiz win` / `whr whz whn` /
  `br bz bin bhn`). Only Axon's default activations (sigmoid gates, tanh) are supported.

  ## Prepared weights

  A call with plain params converts and packs every weight on each call (about 9 MB for a
  2 x 256 LSTM). A caller that runs the same weights many times, as a streaming caller stepping
  one frame at a time does, prepares them once with `prepare/3` and passes the result wherever
  params go (`FusedKernels.lstm/3`, `gru/3`, `lstm_stack/3`, `gru_stack/3`, `native/4`); the
  outputs are the same as with the plain params. On `:cpu` the weights are decoded and packed
  into the CPU kernels' layout once and held by the native library, and a call reuses its
  scratch (ONNX Runtime does the same when it loads a session). On `:cuda` and `:nx`, and for
  f64 weights, the prepared value holds the params and a call runs as with them.

      prepared = FusedKernels.Rnn.prepare(:lstm, [params0, params1], backend: :cpu)
      {seq, states} = FusedKernels.lstm_stack(x, prepared, initial_state: states)
  """

  alias FusedKernels.{Backend, Buffer, Native, Options, Tensor}

  defmodule Prepared do
    @moduledoc """
    LSTM/GRU weights prepared once by `FusedKernels.Rnn.prepare/3`; pass it where the params
    go. `ref` is the native packed-weights handle (`:cpu`, f32/f16/bf16), else nil and the
    call runs on `params`.
    """
    @enforce_keys [:cell, :backend, :layers, :stack?, :params]
    defstruct [:cell, :backend, :device, :layers, :stack?, :params, :ref, row_macs: 0]

    @type t :: %__MODULE__{
            cell: :lstm | :gru,
            backend: :cuda | :cpu | :nx,
            device: non_neg_integer | nil,
            layers: pos_integer,
            stack?: boolean,
            params: [map],
            ref: reference | nil,
            row_macs: non_neg_integer
          }
  end

  @doc """
  Axon's parameter names of one `cell` layer, in gate order: `{input_kernel gates,
  hidden_kernel gates, bias names}` (LSTM `wii wif wig wio` / `whi whf whg who` / `bi bf bg bo`;
  GRU `wir wiz win` / `whr whz whn` / `br bz bin bhn`).
  """
  @spec gate_names(:lstm | :gru) :: {[String.t()], [String.t()], [String.t()]}
  def gate_names(:lstm), do: {~w(wii wif wig wio), ~w(whi whf whg who), ~w(bi bf bg bo)}
  def gate_names(:gru), do: {~w(wir wiz win), ~w(whr whz whn), ~w(br bz bin bhn)}

  @doc false
  @spec options(term) :: keyword
  def options(opts) do
    Options.validate!(opts,
      initial_state: {nil, :any},
      reverse: {false, :boolean},
      precision: {:f32, {:in, [:f32, :tf32]}}
    )
  end

  @doc """
  The layers' tensors in gate order, picked out of Axon's maps by name: a list of
  `{input_kernels, hidden_kernels, biases, initial_state}` (tensors as given). Raises
  `ArgumentError` naming a missing or misplaced parameter.
  """
  @spec layer_tensors(:lstm | :gru, [map], [tuple | nil]) :: [{list, list, list, list}]
  def layer_tensors(cell, params_list, states) do
    unless cell in [:lstm, :gru],
      do: raise(ArgumentError, "cell must be :lstm or :gru, got: #{inspect(cell)}")

    {ins, hids, biases} = gate_names(cell)
    nstate = if cell == :lstm, do: 2, else: 1

    unless is_list(states) and length(states) == length(params_list) do
      raise ArgumentError,
            "initial_state: expected one state per layer (#{length(params_list)}), got: #{inspect(states, limit: 3)}"
    end

    params_list
    |> Enum.zip(states)
    |> Enum.with_index()
    |> Enum.map(fn {{params, state}, l} ->
      pre = if length(params_list) > 1, do: "layer #{l}: ", else: ""

      unless is_map(params),
        do: raise(ArgumentError, "#{pre}params must be a map of Axon's parameters")

      pick = fn group, names ->
        inner =
          case Map.get(params, group) do
            %{} = m when not is_struct(m) ->
              m

            nil ->
              raise ArgumentError, "#{pre}params is missing \"#{group}\""

            _ ->
              raise ArgumentError, "#{pre}params[\"#{group}\"] must be a map of #{inspect(names)}"
          end

        Enum.map(names, fn n ->
          case Map.fetch(inner, n) do
            {:ok, t} -> t
            :error -> raise ArgumentError, "#{pre}params[\"#{group}\"] is missing \"#{n}\""
          end
        end)
      end

      state =
        case state do
          nil ->
            []

          t when is_tuple(t) and tuple_size(t) == nstate and nstate == 2 ->
            Tuple.to_list(t)

          {h} when nstate == 1 ->
            [h]

          other ->
            raise ArgumentError,
                  "#{pre}initial_state must be #{if nstate == 2, do: "{c, h}", else: "{h}"}, got: #{inspect(other, limit: 3)}"
        end

      {pick.("input_kernel", ins), pick.("hidden_kernel", hids), pick.("bias", biases), state}
    end)
  end

  @doc """
  Prepares `params` (one layer's map, or a list of them for a stack) of `cell` for repeated
  calls; see "Prepared weights" above. The backend is chosen as for a call (`backend:`,
  `device:`) and a call with the prepared value runs there: a call that asks for another
  backend raises `ArgumentError`. Raises `ArgumentError` naming a missing, misshapen or
  mistyped parameter.

  ## Options

    * `:backend` - `:auto` (default), `:cpu`, `:cuda` or `:nx`.
    * `:device` - the CUDA device.
  """
  @spec prepare(:lstm | :gru, map | [map], keyword) :: Prepared.t()
  def prepare(cell, params, opts \\ []) do
    opts = Options.validate!(opts, [])

    {stack?, list} =
      case params do
        %Prepared{} ->
          raise ArgumentError, "params: already prepared"

        m when is_map(m) and not is_struct(m) ->
          {false, [m]}

        l when is_list(l) and l != [] ->
          {true, l}

        other ->
          raise ArgumentError,
                "params must be a map (one layer) or a non-empty list of maps, got: #{inspect(other, limit: 3)}"
      end

    layers = layer_tensors(cell, list, List.duplicate(nil, length(list)))
    backend = Backend.select(opts)

    ref =
      if backend == :cpu and type_of(first_kernel(layers)) != {:f, 64} do
        %{params: to_native(layers)} |> Native.rnn_prepare(%{cell: cell}) |> Native.unwrap!()
      end

    %Prepared{
      cell: cell,
      backend: backend,
      device: Backend.device(opts),
      layers: length(list),
      stack?: stack?,
      params: list,
      ref: ref,
      row_macs: row_macs(layers)
    }
  end

  defp first_kernel([{[k | _], _, _, _} | _]), do: k

  # Multiply-adds per row of x (one timestep of one batch row) over every layer's weights.
  defp row_macs(layers) do
    layers
    |> Enum.map(fn {[ki | _] = ins, _, _, _} ->
      {inp, units} = shape_of(ki)
      (inp + units) * units * length(ins)
    end)
    |> Enum.sum()
  end

  defp shape_of(%Buffer{shape: shape}), do: shape
  defp shape_of({_, shape, _}), do: shape

  if Code.ensure_loaded?(Nx) do
    defp shape_of(%Nx.Tensor{} = t), do: Nx.shape(t)
  end

  defp type_of(%Buffer{type: type}), do: type
  defp type_of({_, _, type}), do: type

  if Code.ensure_loaded?(Nx) do
    defp type_of(%Nx.Tensor{} = t), do: Nx.type(t)
  end

  defp type_of(other),
    do:
      raise(
        ArgumentError,
        "params: expected Nx tensors, FusedKernels.Buffers or {binary, shape, type} triples, got: #{inspect(other, limit: 3)}"
      )

  # How a call with prepared weights runs: on the native handle, or on the params with the
  # prepared backend.
  defp route(cell, %Prepared{cell: pcell}, _opts) when pcell != cell,
    do:
      raise(
        ArgumentError,
        "params: prepared for #{inspect(pcell)}, called as #{inspect(cell)}"
      )

  defp route(_cell, %Prepared{} = p, opts) do
    case Keyword.get(opts, :backend) do
      b when b in [nil, :auto] or b == p.backend ->
        :ok

      b ->
        raise ArgumentError,
              "params: prepared for backend #{inspect(p.backend)}, the call asks for " <>
                "#{inspect(b)}; prepare them with backend: #{inspect(b)}"
    end

    cond do
      p.ref == nil ->
        {:params, opts |> Keyword.put(:backend, p.backend) |> put_device(p.device)}

      opts[:out] == :device ->
        raise ArgumentError, "out: the :cpu backend returns host tensors only"

      true ->
        {:native, p.ref}
    end
  end

  defp put_device(opts, nil), do: opts
  defp put_device(opts, d), do: Keyword.put_new_lazy(opts, :device, fn -> d end)

  # The per-layer initial states as native lists ([] for none); the native side checks their
  # shapes and types against the prepared layers. Cheaper than `layer_tensors/3`: a step call
  # of a streaming caller lasts tens of microseconds.
  defp prepared_states(cell, %Prepared{layers: n}, opts) do
    nstate = if cell == :lstm, do: 2, else: 1

    case opts[:initial_state] do
      nil ->
        []

      states when is_list(states) and length(states) == n ->
        states
        |> Enum.with_index()
        |> Enum.map(fn
          {nil, _} ->
            []

          {t, _} when is_tuple(t) and tuple_size(t) == nstate ->
            t |> Tuple.to_list() |> Enum.map(&Tensor.to_native/1)

          {other, l} ->
            pre = if n > 1, do: "layer #{l}: ", else: ""

            raise ArgumentError,
                  "#{pre}initial_state must be #{if nstate == 2, do: "{c, h}", else: "{h}"}, got: #{inspect(other, limit: 3)}"
        end)

      other ->
        raise ArgumentError,
              "initial_state: expected one state per layer (#{n}), got: #{inspect(other, limit: 3)}"
    end
  end

  # Below this many multiply-adds (about 0.1 ms here) a prepared call runs on a dirty
  # scheduler directly: a streamed step then skips the hand-over to the library's worker
  # threads, and it is too short to keep a dirty scheduler from other callers.
  @short_macs 4_194_304

  defp call_prepared(%Prepared{ref: ref, row_macs: row_macs}, x, states, opts) do
    nif =
      case x do
        {_, {b, t, _}, _} when b * t * row_macs <= @short_macs -> &Native.rnn_prepared_dirty/2
        _ -> &Native.rnn_prepared/2
      end

    {seq, states} =
      %{params: ref, x: x, initial_state: states}
      |> nif.(%{reverse: opts[:reverse]})
      |> Native.unwrap!()

    {Buffer.wrap(seq),
     Enum.map(states, fn s -> s |> Enum.map(&Buffer.wrap/1) |> List.to_tuple() end)}
  end

  @doc """
  Runs on a native backend with no Nx: tensors are `{binary, shape, type}` triples or
  `FusedKernels.Buffer`s; returns `{sequence, [state_tuple per layer]}`.
  """
  @spec native(:lstm | :gru, FusedKernels.Tensor.t(), [map] | Prepared.t(), keyword) ::
          {FusedKernels.Tensor.result(), [tuple]}
  def native(cell, x, params_list, opts \\ [])

  def native(cell, x, %Prepared{} = p, opts) do
    opts = options(opts)

    case route(cell, p, opts) do
      {:params, opts} ->
        native(cell, x, p.params, opts)

      {:native, _ref} ->
        call_prepared(p, Tensor.to_native(x), prepared_states(cell, p, opts), opts)
    end
  end

  def native(cell, x, params_list, opts) do
    opts = options(opts)
    states = opts[:initial_state] || List.duplicate(nil, length(params_list))
    layers = layer_tensors(cell, params_list, states)
    call(cell, Tensor.to_native(x), to_native(layers), Backend.select_native(opts), opts)
  end

  # A layer as the NIF takes it: each list in the cell's gate order.
  defp to_native(layers) do
    Enum.map(layers, fn {a, b, c, d} ->
      %{
        input_kernel: Enum.map(a, &Tensor.to_native/1),
        hidden_kernel: Enum.map(b, &Tensor.to_native/1),
        bias: Enum.map(c, &Tensor.to_native/1),
        initial_state: Enum.map(d, &Tensor.to_native/1)
      }
    end)
  end

  defp call(cell, x, layers, backend, opts) do
    {seq, states} =
      %{x: x, params: layers}
      |> Native.rnn(%{
        cell: cell,
        reverse: opts[:reverse],
        precision: opts[:precision],
        backend: backend,
        device: Backend.device(opts),
        out: opts[:out]
      })
      |> Native.unwrap!()

    {Buffer.wrap(seq),
     Enum.map(states, fn s -> s |> Enum.map(&Buffer.wrap/1) |> List.to_tuple() end)}
  end

  if Code.ensure_loaded?(Nx) do
    @doc "One layer: see `FusedKernels.lstm/3`."
    @spec run_one(:lstm | :gru, FusedKernels.Tensor.t(), map | Prepared.t(), keyword) ::
            {FusedKernels.Tensor.nx() | FusedKernels.Tensor.result(), tuple}
    def run_one(cell, x, %Prepared{layers: 1} = p, opts) do
      opts = Keyword.update(options(opts), :initial_state, nil, &(&1 && [&1]))
      {seq, [state]} = run_prepared(cell, x, p, opts)
      {seq, state}
    end

    def run_one(_cell, _x, %Prepared{layers: n}, _opts),
      do:
        raise(
          ArgumentError,
          "params: prepared for a stack of #{n} layers; call the _stack function with them"
        )

    def run_one(cell, x, params, opts) when is_map(params), do: run(cell, x, params, opts)

    def run_one(_cell, _x, params, _opts),
      do:
        raise(
          ArgumentError,
          "params must be a map of Axon's parameters, got: #{inspect(params, limit: 3)}"
        )

    @doc "A stack: see `FusedKernels.lstm_stack/3`."
    @spec run_many(:lstm | :gru, FusedKernels.Tensor.t(), [map] | Prepared.t(), keyword) ::
            {FusedKernels.Tensor.nx() | FusedKernels.Tensor.result(), [tuple]}
    def run_many(cell, x, %Prepared{} = p, opts), do: run_prepared(cell, x, p, options(opts))
    def run_many(cell, x, params, opts) when is_list(params), do: run(cell, x, params, opts)

    def run_many(_cell, _x, params, _opts),
      do:
        raise(
          ArgumentError,
          "params must be a list of Axon parameter maps, got: #{inspect(params, limit: 3)}"
        )

    @doc false
    @spec run(:lstm | :gru, FusedKernels.Tensor.t(), map | [map] | Prepared.t(), keyword) ::
            {FusedKernels.Tensor.nx() | FusedKernels.Tensor.result(), tuple | [tuple]}
    def run(cell, x, %Prepared{stack?: true} = p, opts), do: run_many(cell, x, p, opts)
    def run(cell, x, %Prepared{} = p, opts), do: run_one(cell, x, p, opts)

    def run(cell, x, params, opts) when is_map(params) do
      opts = Keyword.update(options(opts), :initial_state, nil, &(&1 && [&1]))
      {seq, [state]} = run_stack(cell, x, [params], opts)
      {seq, state}
    end

    def run(cell, x, params_list, opts) when is_list(params_list) and params_list != [] do
      run_stack(cell, x, params_list, options(opts))
    end

    def run(_cell, _x, params, _opts),
      do:
        raise(
          ArgumentError,
          "params must be a map (one layer) or a non-empty list of maps, got: #{inspect(params, limit: 3)}"
        )

    # `opts` validated; initial_state as a per-layer list.
    defp run_prepared(cell, x, p, opts) do
      case route(cell, p, opts) do
        {:params, opts} ->
          run_stack(cell, x, p.params, opts)

        {:native, _ref} ->
          states = prepared_states(cell, p, opts)

          case x do
            %Buffer{} ->
              call_prepared(p, Tensor.to_native(x), states, opts)

            x ->
              x = Nx.to_tensor(x)
              Tensor.check!("x", x, rank: 3)

              if Tensor.symbolic?(x),
                do:
                  raise(
                    ArgumentError,
                    "params: prepared for :cpu, which cannot run inside defn; prepare them with backend: :nx there"
                  )

              {seq, states} = call_prepared(p, Tensor.to_native(x), states, opts)
              {Tensor.to_nx(seq), Enum.map(states, &tuple_map(&1, fn t -> Tensor.to_nx(t) end))}
          end
      end
    end

    defp run_stack(cell, %Buffer{} = x, params_list, opts), do: native(cell, x, params_list, opts)

    defp run_stack(cell, x, params_list, opts) do
      x = Nx.to_tensor(x)
      Tensor.check!("x", x, rank: 3)
      states = opts[:initial_state] || List.duplicate(nil, length(params_list))
      layers = layer_tensors(cell, params_list, states)

      for {a, b, c, d} <- layers,
          t <- a ++ b ++ c ++ d,
          is_struct(t, Nx.Tensor),
          do: Tensor.check!("params", t)

      symbolic? =
        Tensor.symbolic?(x) or
          Enum.any?(layers, fn {a, b, c, d} ->
            Enum.any?(a ++ b ++ c ++ d, &Tensor.symbolic?/1)
          end)

      case Backend.select(opts, symbolic?) do
        :nx ->
          # Inside defn: an XLA custom call where EXLA serves it (FusedKernels.XLA).
          with :skip <- FusedKernels.XLA.Ops.rnn(cell, x, layers, opts),
               do: nx(cell, x, layers, opts[:reverse])

        backend ->
          {seq, states} = call(cell, Tensor.to_native(x), to_native(layers), backend, opts)

          if opts[:out] == :device,
            do: {seq, states},
            else:
              {Tensor.to_nx(seq), Enum.map(states, &tuple_map(&1, fn t -> Tensor.to_nx(t) end))}
      end
    end

    defp tuple_map(t, f), do: t |> Tuple.to_list() |> Enum.map(f) |> List.to_tuple()

    @doc """
    The pure-Nx implementation (`FusedKernels.Nx.Rnn`). `layers` as returned by
    `layer_tensors/3`.
    """
    @spec nx(:lstm | :gru, FusedKernels.Tensor.nx(), list, boolean) ::
            {FusedKernels.Tensor.nx(), [tuple]}
    defdelegate nx(cell, x, layers, reverse), to: FusedKernels.Nx.Rnn
  end
end

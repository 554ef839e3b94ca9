package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"maps"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"

	"pilab.hu/pivirt-agent/cmd/internal/version"
	"pilab.hu/pivirt-agent/store"

	"github.com/spf13/cobra"

	"pilab.hu/pivirt-agent/cmd/internal/agent"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/gateway/observe"
)

// Run runs pivirt-agent with args until ctx ends, SIGTERM arrives or the
// agent leaves the cluster through the API.
// An error of the command line itself (an unknown flag or command, a
// missing or extra argument: found before any command runs) is a
// *UsageError; main exits 2 for it, as for bad usage by convention, and 1
// for every other error.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	root := newRootCmd(stdout, stderr)
	root.SetArgs(args)
	started := false
	root.PersistentPreRun = func(*cobra.Command, []string) { started = true }
	cmd, err := root.ExecuteContextC(ctx)
	if err != nil && !started {
		return &UsageError{Err: err, Command: cmd.CommandPath()}
	}
	return err
}

// UsageError is a command line cobra refused before any command ran.
type UsageError struct {
	Err     error
	Command string // the command path whose --help tells the usage
}

func (e *UsageError) Error() string { return e.Err.Error() }
func (e *UsageError) Unwrap() error { return e.Err }

// globalLogs, when set (by main, not by tests running agents side by
// side), receives the agent's logger before the agent starts, for the
// libraries' global loggers (routeLibraryLogs).
var globalLogs func(*slog.Logger)

// newRootCmd is the command tree (also what the CLI reference in docs/ is
// generated from).
func newRootCmd(stdout, stderr io.Writer) *cobra.Command {
	root := &cobra.Command{
		Use:           "pivirt-agent",
		Short:         "PiVirt node agent: embedded Raft cluster, gossip membership and the node's ConnectRPC gateway",
		SilenceUsage:  true,
		SilenceErrors: true,
		Args:          cobra.NoArgs,
	}
	version.AddFlag(root, version.Agent())
	root.SetOut(stdout)
	root.SetErr(stderr)
	flags := config.Register(root.Flags())
	root.RunE = func(cmd *cobra.Command, _ []string) error {
		// What validate refuses, refused here in validate's words before
		// anything starts (the agent's Start runs the same check).
		cfg, err := flags.Resolve()
		if err != nil {
			// The file's own problems as validate words them; a flag's
			// or --dev's as they are.
			var fe *config.FieldError
			var pe *fs.PathError
			if file := flags.ConfigFile(); file != "" && (errors.As(err, &fe) || errors.As(err, &pe)) {
				return fileProblems(file, err)
			}
			return err
		}
		if err := agent.Check(cfg); err != nil {
			if file := flags.ConfigFile(); file != "" {
				return fileProblems(file, err)
			}
			return err
		}
		out, err := logOutput(cfg, stdout)
		if err != nil {
			return err
		}
		levels := new(observe.Levels)
		logger, err := newLogger(cfg, out, levels)
		if err != nil {
			return err
		}
		if globalLogs != nil {
			globalLogs(logger)
		}
		return runAgent(cmd.Context(), cfg, agent.Options{
			Logger: logger, AccessLogger: newAccessLogger(cfg, out), Levels: levels, LoadConfig: flags.Resolve,
		}, stderr)
	}
	root.AddCommand(versionCmd(stdout), recoverCmd(stdout, stderr), validateCmd(stdout), raftCmd(stdout))
	return root
}

func validateCmd(stdout io.Writer) *cobra.Command {
	var file string
	c := &cobra.Command{
		Use:   "validate --config FILE",
		Short: "Check a configuration file offline: its keys and values, and the files it names (policies, certificates)",
		Args:  cobra.NoArgs,
		RunE: func(_ *cobra.Command, _ []string) error {
			if file == "" {
				return &UsageError{Err: errors.New("validate: --config is required: the configuration file to check"), Command: "pivirt-agent validate"}
			}
			cfg, err := config.Load(file)
			if err != nil {
				return fileProblems(file, err)
			}
			// The start's own check (agent.Check), without the start.
			if err := agent.Check(cfg); err != nil {
				return fileProblems(file, err)
			}
			fmt.Fprintf(stdout, "%s: ok\n", file)
			for _, w := range agent.ConfigWarnings(cfg) {
				fmt.Fprintf(stdout, "warning: %s\n", w)
			}
			describeMesh(stdout, cfg)
			return nil
		},
	}
	c.Flags().StringVar(&file, "config", "", "configuration file to check")
	return c
}

// fileProblems names file once before the problems err lists (one per
// line when several), which name their key but not file again. A file
// that cannot be read is named by its read error.
func fileProblems(file string, err error) error {
	var pe *fs.PathError
	if errors.As(err, &pe) && pe.Path == file {
		return fmt.Errorf("%s: %w", file, pe.Err)
	}
	var lines []string
	for _, e := range flatten(err) {
		var fe *config.FieldError
		if errors.As(e, &fe) && fe.File == file {
			c := *fe
			c.File = ""
			e = &c
		}
		lines = append(lines, e.Error())
	}
	if len(lines) == 1 {
		return fmt.Errorf("%s: %s", file, lines[0])
	}
	return fmt.Errorf("%s: %d problems:\n  %s", file, len(lines), strings.Join(lines, "\n  "))
}

// flatten lists the errors errors.Join joined, its own joins included.
func flatten(err error) []error {
	j, ok := err.(interface{ Unwrap() []error })
	if !ok {
		return []error{err}
	}
	var out []error
	for _, e := range j.Unwrap() {
		out = append(out, flatten(e)...)
	}
	return out
}

// describeMesh prints the backends with their scope and the routes in
// force (the defaults when the file has no routing block), and the APIs
// left without a backend.
func describeMesh(w io.Writer, cfg *config.Config) {
	for _, name := range slices.Sorted(maps.Keys(cfg.Backends)) {
		b := cfg.Backends[name]
		fmt.Fprintf(w, "backend %s: %s, scope %s\n", name, b.Endpoint, b.EffectiveScope())
	}
	rules, unrouted := cfg.EffectiveRoutes()
	origin := "routing.rules"
	if len(cfg.Routing.Rules) == 0 {
		origin = "default route"
	}
	for _, r := range rules {
		fmt.Fprintf(w, "%s: %s -> %s\n", origin, r.Match.Prefix, r.Route.Cluster)
	}
	for _, u := range unrouted {
		fmt.Fprintf(w, "not served: %s\n", u)
	}
}

func versionCmd(stdout io.Writer) *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the version",
		Args:  cobra.NoArgs,
		Run: func(*cobra.Command, []string) {
			fmt.Fprintln(stdout, version.Agent())
		},
	}
}

func recoverCmd(stdout, stderr io.Writer) *cobra.Command {
	var dataDir, peers string
	c := &cobra.Command{
		Use:   "recover --data-dir DIR --peers FILE",
		Short: "Disaster recovery: restart a cluster that lost quorum with the servers of a peers file (offline)",
		Long: `recover rewrites the Raft state in --data-dir so that, on its next start, the
agent uses the servers listed in --peers as the cluster's configuration. Use it
only when a cluster has lost quorum for good and cannot elect a leader. Stop the
agent first. The peers file is a JSON array:

  [{"id": "<node-id>", "address": "10.0.0.1:8300"},
   {"id": "<node-id>", "address": "10.0.0.2:8300", "non_voter": true}]

with this node's own ID (the data dir's node-id file) among them. Every entry in
this node's log counts as committed afterwards. See docs/backup.md, "Disaster
recovery", for the whole procedure.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if dataDir == "" || peers == "" {
				return fmt.Errorf("recover: --data-dir and --peers are required")
			}
			servers, err := agent.ReadPeersFile(peers)
			if err != nil {
				return err
			}
			logger := slog.New(slog.NewTextHandler(stderr, observe.HandlerOptions(slog.LevelWarn)))
			if err := agent.Recover(dataDir, servers, logger); err != nil {
				return fmt.Errorf("recover: %w", err)
			}
			fmt.Fprintf(stdout, "Recovered the Raft configuration in %s; on its next start the agent uses:\n", dataDir)
			agent.PrintPeers(stdout, servers)
			fmt.Fprintln(stdout, "Start the agent (and any other listed server, recovered with the same file) without --bootstrap or --bootstrap-expect.")
			return nil
		},
	}
	c.Flags().StringVar(&dataDir, "data-dir", "", "the stopped agent's data directory")
	c.Flags().StringVar(&peers, "peers", "", "JSON file listing the servers of the recovered cluster")
	return c
}

func raftCmd(stdout io.Writer) *cobra.Command {
	c := &cobra.Command{
		Use:   "raft",
		Short: "Offline maintenance of a stopped agent's Raft data",
		Args:  cobra.NoArgs,
	}
	var dataDir, to string
	var segmentMB int
	m := &cobra.Command{
		Use:   "migrate-log-store --data-dir DIR --to wal|boltdb",
		Short: "Convert a stopped agent's Raft log to another log store (offline)",
		Long: `migrate-log-store converts the Raft log in --data-dir to the log store --to:
wal (hashicorp/raft-wal, the default of new data dirs) or boltdb (raft-boltdb,
which data dirs created by earlier versions use). Stop the agent first: a data
dir in use is refused. The log is checked as a start would check it, every entry
Raft still needs is copied, and the new store replaces the old one only once the
copy is complete; a crash leaves a data dir that starts on one or the other, and
the command can be run again. Snapshots and the stable store (term, vote) are not
touched. Convert one node at a time, waiting for it to rejoin before the next:
nodes on different log stores work together.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if dataDir == "" || to == "" {
				return fmt.Errorf("migrate-log-store: --data-dir and --to are required")
			}
			if segmentMB < 1 || segmentMB > 1024 {
				return fmt.Errorf("migrate-log-store: --wal-segment-size-mb %d: must be between 1 and 1024", segmentMB)
			}
			res, err := store.MigrateLogStore(cmd.Context(), dataDir, to, segmentMB<<20)
			if err != nil {
				return err
			}
			if res.Unchanged {
				fmt.Fprintf(stdout, "The raft log in %s already uses %s: nothing to do.\n", dataDir, to)
				return nil
			}
			span := "an empty log"
			if res.Last > 0 {
				span = fmt.Sprintf("entries %d..%d", res.First, res.Last)
			}
			fmt.Fprintf(stdout, "Migrated the raft log in %s from %s to %s (%s).\n", dataDir, res.From, res.To, span)
			fmt.Fprintf(stdout, "Start the agent again; set cluster.raft.log_store: %s in its configuration so that a rebuilt data dir uses it too.\n", res.To)
			return nil
		},
	}
	m.Flags().StringVar(&dataDir, "data-dir", "", "the stopped agent's data directory")
	m.Flags().StringVar(&to, "to", "", "the log store to convert to: wal or boltdb")
	m.Flags().IntVar(&segmentMB, "wal-segment-size-mb", 64, "with --to wal: the size of the WAL's segment files in MiB (cluster.raft.wal_segment_size_mb)")
	c.AddCommand(m)
	return c
}

// logOutput is where logging.output sends the log (and the access log).
func logOutput(cfg *config.Config, stdout io.Writer) (io.Writer, error) {
	switch cfg.Logging.Output {
	case "", "stdout":
		return stdout, nil
	case "stderr":
		return os.Stderr, nil
	}
	f, err := os.OpenFile(cfg.Logging.Output, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o640)
	if err != nil {
		return nil, fmt.Errorf("logging.output: %w", err)
	}
	return f, nil
}

// newLogger is the agent's logger at levels that change live
// (logging.level, logging.components).
func newLogger(cfg *config.Config, out io.Writer, levels *observe.Levels) (*slog.Logger, error) {
	level, comps, err := cfg.Logging.SlogLevels()
	if err != nil {
		return nil, err
	}
	levels.SetLevel(level)
	levels.SetComponents(comps)
	// The inner handler passes every level (Raft's trace included);
	// levels decides.
	opts := observe.HandlerOptions(slog.LevelDebug - 4)
	sampling := observe.Sampling{Initial: cfg.Logging.Sampling.Initial, Thereafter: cfg.Logging.Sampling.Thereafter}
	return slog.New(observe.NewHandler(levels.Handler(handlerFor(cfg.Logging.Format, out, opts)), sampling, nil)), nil
}

func handlerFor(format string, out io.Writer, opts *slog.HandlerOptions) slog.Handler {
	if format == "text" {
		return slog.NewTextHandler(out, opts)
	}
	return slog.NewJSONHandler(out, opts)
}

// newAccessLogger is logging.access_log: a line per API call, in its own
// format, where the log goes, with the request ID; nil when disabled.
func newAccessLogger(cfg *config.Config, out io.Writer) *slog.Logger {
	if !cfg.Logging.AccessLog.Enabled {
		return nil
	}
	return slog.New(observe.NewHandler(handlerFor(cfg.Logging.AccessLog.Format, out, observe.HandlerOptions(nil)), observe.Sampling{}, nil)).With("log", "access")
}

// devBanner tells the operator of a --dev agent how to reach it with
// pvcli: lines to paste into a shell, not a log line.
func devBanner(w io.Writer, c agent.DevCredentials) {
	dataDir := c.DataDir
	if c.TempDataDir {
		dataDir += " (temporary: removed on exit)"
	}
	fmt.Fprintf(w, `
pivirt-agent --dev: one throw-away node on 127.0.0.1 (not for production)
  TLS is on, with a throw-away PiTrust PKI in its data dir
  data dir: %s

To use pvcli, run in your shell:

  export PVCLI_ENDPOINT=%s
  export PVCLI_CA_FILE=%s
  export PVCLI_CERT_FILE=%s
  export PVCLI_KEY_FILE=%s

then, e.g.: pvcli cluster leader

`, dataDir, c.Endpoint, c.CAFile, c.CertFile, c.KeyFile)
	if c.IssuerURL == "" {
		return
	}
	fmt.Fprintf(w, `A development OIDC issuer serves on %s (auth.oidc of this node; its key
is in %s). To call with a bearer token instead of the certificate:

  export TOKEN=$(pitrust dev-token --dir %s --user alice --roles vm-owner)   # or: pvcli login --dir ... --print
  pvcli --endpoint %s --ca-file %s --token "$TOKEN" cluster leader
  curl --cacert %s -H "authorization: Bearer $TOKEN" -H "content-type: application/json" -d '{}' %s/pivirt.cluster.v1.ClusterService/Leader

`, c.IssuerURL, c.IssuerDir, c.IssuerDir, c.Endpoint, c.CAFile, c.CAFile, c.Endpoint)
}

func runAgent(ctx context.Context, cfg *config.Config, opts agent.Options, stderr io.Writer) error {
	logger := opts.Logger
	if cfg.Dev {
		opts.GossipProfile = "local"
	}
	a, err := agent.New(cfg, opts)
	if err != nil {
		return err
	}
	// Catch SIGTERM before starting, so one that arrives during start still
	// shuts down cleanly instead of killing the process.
	term := make(chan os.Signal, 1)
	signal.Notify(term, syscall.SIGTERM)
	defer signal.Stop(term)
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	startCtx, cancel := context.WithTimeout(ctx, time.Minute)
	err = a.Start(startCtx)
	cancel()
	if err != nil {
		return err
	}
	if creds, ok := a.DevCredentials(); ok {
		devBanner(stderr, creds)
	}
	sd := notifier{logger: logger}
	sd.ready("serving on " + a.APIAddr())
	wdCtx, stopWatchdog := context.WithCancel(ctx)
	defer stopWatchdog()
	go sd.watchdog(wdCtx, a.Alive)
	for {
		select {
		case <-hup:
			sd.reloading()
			// The configuration first: refused whole when it does not
			// load or validate; then the files it names.
			if next, err := opts.LoadConfig(); err != nil {
				logger.Error("SIGHUP: configuration not reloaded; the running one stays", "error", err)
			} else if applied, restart, err := a.ReloadConfig(next); err != nil {
				logger.Error("SIGHUP: configuration not reloaded; the running one stays", "error", err)
			} else if len(restart) > 0 {
				logger.Warn("SIGHUP: configuration keys that need a restart to take effect", "restart_required", restart, "applied", applied)
			}
			// Certificates are re-read for new handshakes and the RBAC
			// policy file replaced; what fails to load stays in use and is
			// logged.
			switch reloaded, err := a.Reload(); {
			case err != nil:
				logger.Error("SIGHUP: reload failed; what failed to load stays in use", "reloaded", reloaded, "error", err)
			case len(reloaded) == 0:
				logger.Info("SIGHUP: nothing to reload (tls.enabled is false, no auth.rbac_policy)")
			default:
				logger.Info("SIGHUP: reloaded", "reloaded", reloaded)
			}
			sd.ready("serving on " + a.APIAddr())
			continue
		case <-a.Done():
			sd.stopping()
			return nil
		case <-term:
			sd.stopping()
			if cfg.Cluster.LeaveOnTerminate {
				logger.Info("SIGTERM: leaving the cluster (cluster.leave_on_terminate)")
				return a.Leave(context.Background())
			}
			logger.Info("SIGTERM: shutting down without leaving")
			hctx, hcancel := context.WithTimeout(context.Background(), 10*time.Second)
			a.HandOff(hctx)
			hcancel()
		case <-ctx.Done():
			sd.stopping()
			logger.Info("interrupted: shutting down without leaving")
		}
		return a.Shutdown()
	}
}

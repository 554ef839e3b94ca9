package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"pilab.hu/pivirt-agent/cmd/internal/version"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/protobuf/types/known/durationpb"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
)

const (
	envEndpoint     = "PVCLI_ENDPOINT"
	envCAFile       = "PVCLI_CA_FILE"
	envCertFile     = "PVCLI_CERT_FILE"
	envKeyFile      = "PVCLI_KEY_FILE"
	envToken        = "PVCLI_TOKEN"
	defaultEndpoint = "127.0.0.1:8443"
	defaultTimeout  = 15 * time.Second
)

// Values accepted by --output and --consistency.
var (
	outputFormats     = []string{"table", "json", "yaml"}
	consistencyModes  = []string{"default", "consistent", "stale"}
	consistencyValues = map[string]clusterv1.Consistency{
		"default":    clusterv1.Consistency_CONSISTENCY_DEFAULT,
		"consistent": clusterv1.Consistency_CONSISTENCY_CONSISTENT,
		"stale":      clusterv1.Consistency_CONSISTENCY_STALE,
	}
)

// Run executes pvcli with args (without the program name), writing results
// to stdout and diagnostics to stderr. A non-nil error has already been
// printed to stderr as "Error: <msg>"; exitCode maps it to the exit status.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	return run(ctx, args, os.Getenv, os.Stdin, stdout, stderr)
}

// run is Run with the process environment and stdin injected, for tests.
func run(ctx context.Context, args []string, getenv func(string) string, stdin io.Reader, stdout, stderr io.Writer) error {
	a := &app{
		getenv:   getenv,
		stdin:    stdin,
		stdout:   stdout,
		stderr:   stderr,
		terminal: isTerminal,
		clientID: newClientID(),
	}
	return a.run(ctx, args)
}

// run executes the command line args with a's streams and environment.
func (a *app) run(ctx context.Context, args []string) error {
	defer a.close()
	stdin, stdout, stderr := a.stdin, a.stdout, a.stderr

	root := a.newRootCmd()
	root.SetArgs(args)
	root.SetIn(stdin)
	root.SetOut(stdout)
	root.SetErr(stderr)
	cmd, err := root.ExecuteContextC(ctx)
	if err == nil {
		return nil
	}
	if es := exitStatus(0); errors.As(err, &es) {
		return err // a console's shell ended so: its status, nothing to add
	}
	// Errors raised by cobra itself (unknown command, flag parsing) happen
	// before any command body runs: they are usage errors too.
	var ue *usageError
	if !errors.As(err, &ue) && !a.inCommand {
		err = &usageError{err: err}
	}
	fmt.Fprintf(stderr, "Error: %v\n", err)
	if errors.As(err, &ue) {
		fmt.Fprintf(stderr, "Run '%s --help' for usage.\n", cmd.CommandPath())
	}
	switch connect.CodeOf(err) {
	case connect.CodeUnauthenticated:
		fmt.Fprintf(stderr, "The agent did not accept the credentials: send a bearer token (--token or %s) or a client certificate of the PiTrust chain (--cert-file/--key-file, %s/%s, or %s and %s).\n",
			envToken, envCertFile, envKeyFile, defaultCertFile, defaultKeyFile)
	case connect.CodePermissionDenied:
		fmt.Fprintln(stderr, hintPermissionDenied)
	case connect.CodeResourceExhausted:
		if wait, ok := retryDelay(err); ok {
			fmt.Fprintf(stderr, "The agent's rate limit for your identity was reached; retry in %s.\n", wait)
		}
	case connect.CodeUnavailable:
		switch {
		case (tlsRefusal(err) || a.tlsRefused.Load()) && a.target != nil:
			explainCertRefusal(stderr, a.target.tls, time.Now())
		case a.target != nil && !connect.IsWireError(err) && !permanentTransportError(err):
			// Not the agent's answer (those say why themselves), nor
			// pvcli refusing the agent's certificate.
			explainUnclearFailure(stderr, a.target.tls, time.Now())
		}
		if noLeader(err) {
			fmt.Fprintln(stderr, hintNoLeader)
		}
	}
	return err
}

// The hints under an error; the web UI shows the same words (ui/src/api.ts,
// checked by TestUIHintsMatch).
const (
	hintPermissionDenied = "The agent's RBAC policy does not allow this call for your identity (the message names the resource and verb); ask for a role that does."
	hintNoLeader         = "The cluster has no leader: writes and default or consistent reads wait for one. A read with --consistency stale is answered by the agent asked, from its own copy of the state (--max-stale bounds how old). A leader is elected once a majority of the voters reach each other again: start the stopped agents or mend the network."
)

// reasonNoLeader is the google.rpc.ErrorInfo reason of an agent's error
// for a request that found no leader (gateway.ReasonNoLeader).
const reasonNoLeader = "NO_LEADER"

// reasonStoreUnavailable is the ErrorInfo reason of an agent in etcd mode
// whose etcd did not answer for its whole wait
// (gateway.ReasonStoreUnavailable).
const reasonStoreUnavailable = "STORE_UNAVAILABLE"

// noLeader reports whether err is an agent's answer that the cluster has
// no leader, after the agent waited for one.
func noLeader(err error) bool { return hasReason(err, reasonNoLeader) }

// waitedInVain reports whether err is an agent's answer after it waited
// the whole hold timeout: for a leader, or (etcd mode) for etcd.
func waitedInVain(err error) bool { return hasReason(err, reasonNoLeader, reasonStoreUnavailable) }

// hasReason reports whether err carries a google.rpc.ErrorInfo with one
// of reasons.
func hasReason(err error, reasons ...string) bool {
	var ce *connect.Error
	if !errors.As(err, &ce) {
		return false
	}
	for _, d := range ce.Details() {
		if v, err := d.Value(); err == nil {
			if ei, ok := v.(*errdetails.ErrorInfo); ok && slices.Contains(reasons, ei.GetReason()) {
				return true
			}
		}
	}
	return false
}

// retryDelay is the RetryInfo hint of an error, when it carries one.
func retryDelay(err error) (time.Duration, bool) {
	var ce *connect.Error
	if !errors.As(err, &ce) {
		return 0, false
	}
	for _, d := range ce.Details() {
		if v, err := d.Value(); err == nil {
			if ri, ok := v.(*errdetails.RetryInfo); ok {
				return ri.GetRetryDelay().AsDuration(), true
			}
		}
	}
	return 0, false
}

// exitCode maps an error returned by Run to the process exit status:
// 0 on success, 2 for bad input (usage), 1 for anything else.
func exitCode(err error) int {
	var ue *usageError
	es := exitStatus(0)
	switch {
	case err == nil:
		return 0
	case errors.As(err, &es):
		return int(es)
	case errors.As(err, &ue):
		return 2
	default:
		return 1
	}
}

// usageError is bad input found before any RPC was sent.
type usageError struct{ err error }

func (e *usageError) Error() string { return e.err.Error() }
func (e *usageError) Unwrap() error { return e.err }

func usagef(format string, args ...any) error {
	return &usageError{err: fmt.Errorf(format, args...)}
}

// globalOptions are the persistent flags of the root command.
type globalOptions struct {
	endpoint    string
	context     string
	output      enumFlag
	consistency enumFlag
	maxStale    time.Duration
	waitIndex   uint64
	wait        time.Duration
	timeoutSet  bool // --timeout was given
	timeout     time.Duration
	verbose     bool
	noProgress  bool
	tls         tlsOptions
	token       string
}

// app is the state of one pvcli invocation.
type app struct {
	// tlsRefused is set when an agent refused a TLS handshake over the
	// client certificate during this run.
	tlsRefused atomic.Bool
	getenv     func(string) string
	stdin      io.Reader
	stdout     io.Writer
	stderr     io.Writer
	// terminal reports whether a writer is a terminal: progress is shown
	// on stderr only then (isTerminal; tests force it).
	terminal func(io.Writer) bool

	opts globalOptions

	// clientID and seq identify this process's writes (WriteOptions), so
	// that a retried write is applied once.
	clientID string
	seq      atomic.Uint64

	conn      *clientConn // built on first use
	target    *target     // where and how conn reaches the cluster
	inCommand bool        // a command body started running
	// warned: the unavailable nodes already named (warnUnavailable).
	warned map[string]bool
}

func (a *app) close() {
	if a.conn != nil {
		a.conn.close()
	}
}

func newClientID() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails (it aborts the program)
	return hex.EncodeToString(b[:])
}

func (a *app) newRootCmd() *cobra.Command {
	a.opts.output = enumFlag{value: "table", allowed: outputFormats}
	a.opts.consistency = enumFlag{value: "default", allowed: consistencyModes}

	root := &cobra.Command{
		Use:   "pvcli",
		Short: "Operate a PiVirt agent cluster",
		Long: `pvcli operates a PiVirt agent cluster through the ClusterService API of
any agent. Writes are forwarded to the Raft leader by the agent asked; a write
interrupted by an unavailable cluster is retried with the same client ID and
sequence number until --timeout, so it is never applied twice.

vm, volume and network use the VM, storage and network APIs that the agent
asked proxies to its backends (pivirtd, iscsiman); pvcli does not retry them,
the agent retries what is safe to retry.`,
		SilenceErrors: true,
		SilenceUsage:  true,
		Args:          noSubcommand,
		RunE:          helpOnly,

		SuggestionsMinimumDistance: 2,
	}
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error {
		return &usageError{err: err}
	})

	f := root.PersistentFlags()
	f.StringVar(&a.opts.endpoint, "endpoint", defaultEndpoint,
		"agent API addresses, comma-separated, tried in turn when one cannot be reached: http://HOST:PORT, https://HOST:PORT or HOST:PORT (https:// when a CA or client certificate is given, else http://); env "+envEndpoint)
	f.StringVar(&a.opts.context, "context", "", "context of the pvcli configuration file to use (default: its current context); env "+envContext)
	f.VarP(&a.opts.output, "output", "o", "output format: "+strings.Join(outputFormats, "|"))
	f.Var(&a.opts.consistency, "consistency", "read consistency: "+strings.Join(consistencyModes, "|"))
	f.DurationVar(&a.opts.maxStale, "max-stale", 0,
		"with --consistency stale: forward the read to the leader when the node asked last heard from it longer ago than this")
	f.Uint64Var(&a.opts.waitIndex, "wait-index", 0,
		"blocking query: answer once the read's index (Pivirt-Index, printed by --verbose; meta.index with -o json) is above this, or after --wait")
	f.DurationVar(&a.opts.wait, "wait", 0, "with --wait-index: the longest wait (server default 5m, at most 10m)")
	f.DurationVar(&a.opts.timeout, "timeout", defaultTimeout, "deadline of the whole command, retries included")
	f.BoolVarP(&a.opts.verbose, "verbose", "v", false, "print response metadata headers and retries to stderr")
	f.BoolVar(&a.opts.noProgress, "no-progress", false, "show no progress of snapshot save and restore and volume upload (shown on stderr only when it is a terminal and TERM is not dumb)")
	f.StringVar(&a.opts.tls.caFile, "ca-file", "", "with https://: PEM file of the CAs that sign the agent's certificate, e.g. /etc/pivirt/certs/ca-chain.pem (default: the system roots); env "+envCAFile)
	f.StringVar(&a.opts.tls.certFile, "cert-file", "", "with https://: client certificate, for agents that require one; env "+envCertFile)
	f.StringVar(&a.opts.tls.keyFile, "key-file", "", "with https://: the client certificate's key; env "+envKeyFile)
	f.StringVar(&a.opts.token, "token", "", "OIDC bearer token sent as Authorization: Bearer (https://, or http:// to loopback only); env "+envToken)

	root.AddCommand(a.newClusterCmd(), a.newServiceCmd(), a.newConfigCmd(), a.newSnapshotCmd(),
		a.newVMCmd(), a.newVolumeCmd(), a.newNetworkCmd(), a.newScheduleCmd(), a.newRBACCmd(), a.newPolicyCmd(), a.newVersionCmd(), a.newContextCmd(),
		a.newOperatorCmd(), a.newMonitorCmd(), a.newDebugCmd(), a.newLoginCmd(), a.newWhoAmICmd())
	version.AddFlag(root, version.Get("pvcli"))
	return root
}

// command wraps a command body and marks that it started: from then on an
// error is a runtime error unless the body returns a *usageError.
func (a *app) command(fn func(cmd *cobra.Command, args []string) error) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, args []string) error {
		a.inCommand = true
		a.opts.timeoutSet = cmd.Flags().Changed("timeout")
		return fn(cmd, args)
	}
}

// groupCmd is a command that only holds subcommands.
func groupCmd(use, short string, subs ...*cobra.Command) *cobra.Command {
	c := &cobra.Command{
		Use:   use,
		Short: short,
		Args:  noSubcommand,
		RunE:  helpOnly,

		SuggestionsMinimumDistance: 2,
	}
	c.AddCommand(subs...)
	return c
}

// noSubcommand rejects an unknown subcommand of a group command.
func noSubcommand(cmd *cobra.Command, args []string) error {
	if len(args) == 0 {
		return nil
	}
	msg := fmt.Sprintf("unknown command %q for %q", args[0], cmd.CommandPath())
	if s := cmd.SuggestionsFor(args[0]); len(s) > 0 {
		msg += fmt.Sprintf(" (did you mean %q?)", s[0])
	}
	return &usageError{err: errors.New(msg)}
}

func helpOnly(cmd *cobra.Command, _ []string) error {
	return cmd.Help()
}

// positional validates positional arguments against their names as shown in
// the usage line: "NAME" is required, "[ID]" optional, "ADDR..." one or more.
// Every argument given must be non-empty.
func positional(names ...string) cobra.PositionalArgs {
	required, limit := 0, len(names)
	for _, n := range names {
		if !strings.HasPrefix(n, "[") {
			required++
		}
		if strings.HasSuffix(n, "...") {
			limit = -1
		}
	}
	name := func(i int) string {
		if i >= len(names) {
			i = len(names) - 1
		}
		return strings.Trim(names[i], "[].")
	}
	return func(cmd *cobra.Command, args []string) error {
		switch {
		case len(args) < required:
			return usagef("missing argument %s (usage: %s)", name(len(args)), cmd.UseLine())
		case limit >= 0 && len(args) > limit:
			return usagef("unexpected argument %q (usage: %s)", args[limit], cmd.UseLine())
		}
		for i, arg := range args {
			if strings.TrimSpace(arg) == "" {
				return usagef("argument %s must not be empty", name(i))
			}
		}
		return nil
	}
}

// enumFlag is a string flag restricted to a set of values.
type enumFlag struct {
	value   string
	allowed []string
}

func (e *enumFlag) String() string { return e.value }
func (e *enumFlag) Type() string   { return strings.Join(e.allowed, "|") }

func (e *enumFlag) Set(s string) error {
	if !slices.Contains(e.allowed, s) {
		return fmt.Errorf("must be one of %s", strings.Join(e.allowed, "|"))
	}
	e.value = s
	return nil
}

// readOptions builds the ReadOptions of a read RPC from the global flags.
func (a *app) readOptions() *clusterv1.ReadOptions {
	ro := &clusterv1.ReadOptions{Consistency: consistencyValues[a.opts.consistency.value]}
	ro.WaitIndex = a.opts.waitIndex
	if a.opts.wait > 0 {
		ro.WaitTime = durationpb.New(a.opts.wait)
	}
	if a.opts.maxStale > 0 {
		ro.MaxStale = durationpb.New(a.opts.maxStale)
	}
	return ro
}

// readFlags are the global flags readOptions reads.
var readFlags = []string{"consistency", "max-stale", "wait-index", "wait"}

// readOptionsIfSet is readOptions when a read flag was given, else nil:
// the read's own default, for reads whose default is not the cluster's
// (schedule reads are consistent without options).
func (a *app) readOptionsIfSet(cmd *cobra.Command) *clusterv1.ReadOptions {
	for _, name := range readFlags {
		if cmd.Flags().Changed(name) {
			return a.readOptions()
		}
	}
	return nil
}

// writeOptions returns the WriteOptions for the next write of this process.
// A retry reuses the request, hence the same options.
func (a *app) writeOptions() *clusterv1.WriteOptions {
	return &clusterv1.WriteOptions{ClientId: a.clientID, Sequence: a.seq.Add(1)}
}

// validateGlobals checks the global flags that cannot be checked while they
// are parsed. It runs before the first RPC of a command.
func (a *app) validateGlobals() error {
	if a.opts.timeout <= 0 {
		return usagef("invalid --timeout %s: must be a positive duration such as 15s", a.opts.timeout)
	}
	if a.opts.wait < 0 {
		return usagef("invalid --wait %s: must not be negative", a.opts.wait)
	}
	if a.opts.wait > 0 && a.opts.waitIndex == 0 {
		return usagef("--wait applies only with --wait-index")
	}
	if a.opts.waitIndex > 0 && !a.opts.timeoutSet {
		// A blocking query may wait its whole --wait (the server's 5m
		// by default, plus jitter) before the usual deadline starts.
		wait := a.opts.wait
		if wait == 0 {
			wait = 5 * time.Minute
		}
		a.opts.timeout = wait + wait/16 + defaultTimeout
	}
	if a.opts.maxStale < 0 {
		return usagef("invalid --max-stale %s: must not be negative", a.opts.maxStale)
	}
	if a.opts.maxStale > 0 && a.opts.consistency.value != "stale" {
		return usagef("--max-stale applies only to --consistency stale (got --consistency %s)", a.opts.consistency.value)
	}
	return nil
}

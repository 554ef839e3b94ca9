package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"

	"pilab.hu/pivirt-agent/cmd/internal/version"

	"github.com/spf13/cobra"

	"pilab.hu/pivirt-agent/identity"
	"pilab.hu/pivirt-agent/identity/castore"
)

// DefaultDir is where the agent's configuration expects the certificates
// (server.connectrpc.tls.*, tls.* of the reference configuration).
const DefaultDir = "/etc/pivirt/certs"

// usageError is bad input: exit status 2.
type usageError struct{ err error }

func (e *usageError) Error() string { return e.err.Error() }
func (e *usageError) Unwrap() error { return e.err }

// envDir names the directory of the CA when --dir is not given (the
// default is DefaultDir).
const envDir = "PITRUST_DIR"

// Run runs pitrust with args, writing results to stdout.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	root := newRootCmd(stdout, stderr)
	root.SetArgs(args)
	err := root.ExecuteContext(ctx)
	if err != nil && strings.HasPrefix(err.Error(), "unknown command") {
		err = &usageError{err}
	}
	return err
}

// newRootCmd is the command tree (also what the CLI reference in docs/ is
// generated from).
func newRootCmd(stdout, stderr io.Writer) *cobra.Command {
	var dir string
	root := &cobra.Command{
		Use:   "pitrust",
		Short: "Create the PiTrust CA and issue mTLS certificates for PiVirt components",
		Long: `pitrust keeps a PiTrust PKI in a directory (--dir, default ` + DefaultDir + `):

  PiRootR1.pem, PiRootR1.key   PiTrust Root CA
  PiCA.pem, PiCA.key           PiTrust X1 Intermediate CA, signed by the root
  ca-chain.pem                 the intermediate and the root: what peers trust
  <name>.crt, <name>.key       leaves signed by X1 (the .crt also holds X1;
                               --out NAME names the files instead of --name)
  <name>.crt.prev, .key.prev   what the last reissue of <name> replaced
  dev-oidc.key, .secret        the development OIDC issuer's signing key and
                               client secret (dev-issuer, dev-token)

Keys are ECDSA P-256, written 0600. Issuing a leaf again replaces its files and
keeps the old ones as .prev (--force: keep nothing). init never replaces a CA
without --force. Keep the root key offline once the intermediate exists.

pitrust serve keeps the X1 intermediate online as the PiTrust CA server: the
certificate API over TLS (issue, renew, revoke, list, bootstrap tokens), OCSP
and the CRL over plain HTTP, and an inventory of every certificate issued.
token create, request, revoke and list talk to it (--server URL, with an
operator certificate: --cert, --key); revoke and list also work offline on its
database (--db PATH) while it is stopped.`,
		SilenceUsage:  true,
		SilenceErrors: true,
		Args:          cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if len(args) > 0 {
				return &usageError{fmt.Errorf("unknown command %q for \"pitrust\"", args[0])}
			}
			return cmd.Help()
		},
	}
	version.AddFlag(root, version.Get("pitrust"))
	root.SetOut(stdout)
	root.SetErr(stderr)
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return &usageError{err} })
	root.PersistentFlags().StringVar(&dir, "dir", DefaultDir, "directory of the CA and of the certificates issued (env "+envDir+")")
	root.PersistentPreRun = func(cmd *cobra.Command, _ []string) {
		if v := os.Getenv(envDir); v != "" && !cmd.Flags().Changed("dir") {
			dir = v
		}
	}
	root.AddCommand(initCmd(&dir, stdout), issueCmd(&dir, identity.KindServer, stdout), issueCmd(&dir, identity.KindClient, stdout),
		verifyCmd(&dir, stdout), inspectCmd(&dir, stdout), devIssuerCmd(&dir, stdout, stderr), devTokenCmd(&dir, stdout), versionCmd(stdout),
		serveCmd(stderr), tokenCmd(&dir, stdout), requestCmd(&dir, stdout), revokeCmd(&dir, stdout), listCmd(&dir, stdout), operatorCmd(stderr))
	return root
}

func initCmd(dir *string, stdout io.Writer) *cobra.Command {
	var opts identity.CAOptions
	c := &cobra.Command{
		Use:   "init",
		Short: "Create the PiTrust Root CA, the X1 Intermediate CA and ca-chain.pem",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if opts.RootDays < 1 || opts.IntermediateDays < 1 {
				return &usageError{fmt.Errorf("--root-days and --ca-days must be at least 1")}
			}
			files, err := identity.InitCA(*dir, opts)
			if err != nil {
				return err
			}
			fmt.Fprintf(stdout, "Created the PiTrust CA in %s:\n  %s\n  %s\n  %s (key)\n  %s (key)\n  %s\n",
				*dir, files.RootCert, files.IntermediateCert, files.RootKey, files.IntermediateKey, files.Chain)
			return nil
		},
	}
	c.Flags().IntVar(&opts.RootDays, "root-days", identity.DefaultRootDays, "lifetime of the root CA in days")
	c.Flags().IntVar(&opts.IntermediateDays, "ca-days", identity.DefaultIntermediateDays, "lifetime of the X1 intermediate CA in days")
	c.Flags().BoolVar(&opts.Force, "force", false, "replace an existing CA (every certificate it issued stops being trusted)")
	return c
}

func issueCmd(dir *string, kind identity.Kind, stdout io.Writer) *cobra.Command {
	var (
		req    identity.LeafRequest
		ips    []string
		usages []string
		dbPath string
	)
	req.Kind = kind
	own := strings.TrimPrefix(string(kind), "mtls-")
	c := &cobra.Command{
		Use:   "issue-" + string(kind) + " --name NAME",
		Short: "Issue an mTLS " + own + " certificate signed by the X1 intermediate CA",
		Long: "Issue an mTLS " + own + ` certificate signed by the X1 intermediate CA, written to
<dir>/<out>.crt and <out>.key (0600); --out defaults to --name. A certificate
for both ends of mutual TLS takes --usage server,client (a server usage needs
--dns or --ip, or a --name that is a host name).

Issuing again under the same file name replaces the files and keeps the old
ones as <out>.crt.prev and <out>.key.prev (the key 0600), replacing older
copies, so that the previous pair can be put back; --force replaces the files
keeping nothing.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if req.Name == "" {
				return &usageError{fmt.Errorf("--name is required")}
			}
			req.Usages = nil
			for _, u := range usages {
				if u != string(identity.UsageServer) && u != string(identity.UsageClient) {
					return &usageError{fmt.Errorf("--usage %q: want server, client or both (--usage server,client)", u)}
				}
				req.Usages = append(req.Usages, identity.Usage(u))
			}
			if req.Days < 1 {
				return &usageError{fmt.Errorf("--days %d: must be at least 1", req.Days)}
			}
			for _, s := range ips {
				ip := net.ParseIP(s)
				if ip == nil {
					return &usageError{fmt.Errorf("--ip %q is not an IP address", s)}
				}
				req.IPs = append(req.IPs, ip)
			}
			var db *castore.DB
			if dbPath != "" {
				var err error
				if db, err = openDB(dbPath); err != nil {
					return err
				}
				defer db.Close()
				if u := strings.TrimSuffix(db.ExternalURL(), "/"); u != "" {
					req.OCSPServer = []string{u + "/ocsp"}
					req.CRLDistributionPoints = []string{u + "/crl"}
				}
			}
			files, err := identity.Issue(*dir, req)
			if err != nil {
				return err
			}
			certs, err := identity.ReadCertificates(files.Cert)
			if err != nil {
				return err
			}
			if db != nil {
				if err := db.Record(certs[0], "pitrust (offline)"); err != nil {
					return fmt.Errorf("issued %s, but recording it in %s failed: %w", files.Cert, dbPath, err)
				}
			}
			info := identity.Describe(certs[0], time.Now())
			fmt.Fprintf(stdout, "Issued %s for %s, valid until %s\n  %s\n  %s (key)\n", kind, info.Subject,
				info.NotAfter.Format(time.RFC3339), files.Cert, files.Key)
			fmt.Fprintf(stdout, "  usage: %s\n", strings.Join(info.ExtKeyUsage, ", "))
			if sans := append(append(append([]string(nil), info.DNSNames...), info.IPAddresses...), info.URIs...); len(sans) > 0 {
				fmt.Fprintf(stdout, "  names: %s\n", strings.Join(sans, ", "))
			}
			if stem, ok := agentFileStems[kind]; ok && req.File == "" {
				fmt.Fprintf(stdout, "  note: the agent's default configuration reads /etc/pivirt/certs/%s.crt and .key (%s); --out %s names the files so\n", stem, agentFileKeys[kind], stem)
			}
			if strings.HasPrefix(req.Name, identity.AgentPrefix) && req.Cluster == "" && kind == identity.KindClient {
				fmt.Fprintf(stdout, "  note: it names no cluster: agents of other clusters on this CA are accepted as peers; pass --cluster <cluster.name> to bind it\n")
			}
			if files.PrevCert != "" || files.PrevKey != "" {
				fmt.Fprintf(stdout, "  the files replaced are kept as:\n")
				for _, p := range []string{files.PrevCert, files.PrevKey} {
					if p != "" {
						fmt.Fprintf(stdout, "    %s\n", p)
					}
				}
			}
			return nil
		},
	}
	req.KeepPrevious = true
	c.Flags().StringVar(&req.Name, "name", "", "certificate name: its CN, and the file names unless --out is given")
	c.Flags().StringVar(&req.File, "out", "", "file name stem in --dir: <out>.crt and <out>.key (default: --name), e.g. agent-server")
	c.Flags().StringSliceVar(&usages, "usage", []string{own}, "what the certificate is for: server, client, or both (server,client)")
	c.Flags().IntVar(&req.Days, "days", identity.DefaultLeafDays, "lifetime in days")
	c.Flags().BoolVar(&req.Force, "force", false, "replace existing files of that name without keeping them (by default they are kept as <out>.crt.prev and <out>.key.prev)")
	c.Flags().StringVar(&dbPath, "db", "", "record the certificate in this CA database (pitrust serve's server.db_path; not while it runs) and, when a server recorded its external URL there, point the certificate's OCSP and CRL at it")
	if kind == identity.KindServer {
		c.Flags().StringArrayVar(&req.DNS, "dns", nil, "DNS name the server answers to (repeatable; default: --name when it is a host name)")
		c.Flags().StringArrayVar(&ips, "ip", nil, "IP address the server answers on (repeatable)")
	} else {
		c.Flags().StringArrayVar(&req.DNS, "dns", nil, "service identity the holder acts as, matched by network policies (repeatable; e.g. agent.pivirt.internal)")
		c.Flags().StringVar(&req.Cluster, "cluster", "", "for an agent's certificate (--name pivirt-agent-<node>): the cluster it belongs to (its cluster.name); agents of other clusters on the same CA are then refused")
	}
	return c
}

// inDir is file, or the file of that name in dir when file names no
// directory and is not in the current one (pitrust verify agent-server.crt
// on a node, from any directory).
func inDir(dir, file string) string {
	if filepath.Base(file) != file {
		return file
	}
	if _, err := os.Stat(file); err == nil {
		return file
	}
	if _, err := os.Stat(filepath.Join(dir, file)); err == nil {
		return filepath.Join(dir, file)
	}
	return file
}

func verifyCmd(dir *string, stdout io.Writer) *cobra.Command {
	var (
		ca, name, output string
	)
	c := &cobra.Command{
		Use:   "verify CERT",
		Short: "Check a certificate against the CA chain, for its own purpose (and --name), and explain the chain",
		Long: `Check a certificate against the CA chain, for its own purpose (and --name), and
explain the chain. A file name without a directory that is not in the
current directory is looked for in --dir.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			args[0] = inDir(*dir, args[0])
			if err := checkOutput(output); err != nil {
				return err
			}
			if ca == "" {
				ca = filepath.Join(*dir, identity.ChainFile)
			}
			res, err := identity.Verify(args[0], ca, name, time.Now())
			if err != nil {
				return fmt.Errorf("%s: NOT trusted: %w", args[0], err)
			}
			if output == "json" {
				return writeJSON(stdout, res)
			}
			fmt.Fprintf(stdout, "%s: OK (trusted by %s for %s)\n", args[0], ca, res.Usage)
			for i, c := range res.Chain {
				fmt.Fprintf(stdout, "\nchain[%d]:\n", i)
				describe(stdout, c)
			}
			return nil
		},
	}
	c.Flags().StringVar(&ca, "ca", "", "PEM file of trusted CAs (default <dir>/ca-chain.pem)")
	c.Flags().StringVar(&name, "name", "", "also check that the certificate is valid for this DNS name or IP")
	c.Flags().StringVarP(&output, "output", "o", "text", "output format: text|json")
	return c
}

func inspectCmd(dir *string, stdout io.Writer) *cobra.Command {
	var output string
	c := &cobra.Command{
		Use:   "inspect CERT",
		Short: "Explain every certificate of a PEM file: subject, issuer, names, usages, validity",
		Long: `Explain every certificate of a PEM file: subject, issuer, names, usages,
validity. A file name without a directory that is not in the current
directory is looked for in --dir.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			args[0] = inDir(*dir, args[0])
			if err := checkOutput(output); err != nil {
				return err
			}
			certs, err := identity.ReadCertificates(args[0])
			if err != nil {
				return err
			}
			var infos []identity.CertInfo
			for _, c := range certs {
				infos = append(infos, identity.Describe(c, time.Now()))
			}
			if output == "json" {
				return writeJSON(stdout, infos)
			}
			for i, info := range infos {
				if i > 0 {
					fmt.Fprintln(stdout)
				}
				fmt.Fprintf(stdout, "certificate[%d]:\n", i)
				describe(stdout, info)
			}
			return nil
		},
	}
	c.Flags().StringVarP(&output, "output", "o", "text", "output format: text|json")
	return c
}

func checkOutput(o string) error {
	if o != "text" && o != "json" {
		return &usageError{fmt.Errorf("--output %q: want text or json", o)}
	}
	return nil
}

// writeJSON writes v as indented JSON; its field names are lowerCamelCase
// and times RFC 3339, as pvcli's -o json.
func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetEscapeHTML(false)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// describe prints one certificate's explanation, indented.
func describe(w io.Writer, c identity.CertInfo) {
	rows := [][2]string{
		{"Subject", c.Subject},
		{"Issuer", c.Issuer},
		{"Serial", c.Serial},
		{"Valid", fmt.Sprintf("%s to %s (%s)", c.NotBefore.Format(time.RFC3339), c.NotAfter.Format(time.RFC3339), expiry(int(c.ExpiresInDays)))},
	}
	add := func(k string, v []string) {
		if len(v) > 0 {
			rows = append(rows, [2]string{k, strings.Join(v, ", ")})
		}
	}
	if c.IsCA {
		add("CA", []string{"yes"})
	}
	add("DNS names", c.DNSNames)
	add("IP addresses", c.IPAddresses)
	add("Key usage", c.KeyUsage)
	add("Extended key usage", c.ExtKeyUsage)
	rows = append(rows, [2]string{"Public key", c.PublicKey}, [2]string{"SHA-256", c.SHA256})
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	for _, r := range rows {
		fmt.Fprintf(tw, "  %s\t%s\n", r[0], r[1])
	}
	tw.Flush()
}

func expiry(days int) string {
	switch {
	case days < 0:
		return "EXPIRED"
	case days < 30:
		return fmt.Sprintf("expires in %d days: renew it", days)
	default:
		return fmt.Sprintf("%d days left", days)
	}
}

func versionCmd(stdout io.Writer) *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the version",
		Args:  cobra.NoArgs,
		Run: func(*cobra.Command, []string) {
			fmt.Fprintln(stdout, version.Get("pitrust"))
		},
	}
}

// agentFileStems are the file name stems of the agent's certificates in
// its default configuration (/etc/pivirt/certs/agent-server.crt, …), by
// kind, and agentFileKeys the configuration keys that name them: what
// issue-mtls-server and issue-mtls-client point to when --out is not
// given, as the file names differ from --name.
var (
	agentFileStems = map[identity.Kind]string{identity.KindServer: "agent-server", identity.KindClient: "agent-client"}
	agentFileKeys  = map[identity.Kind]string{identity.KindServer: "server.connectrpc.tls.cert_file", identity.KindClient: "tls.cert_file"}
)

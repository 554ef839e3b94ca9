package access

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"encoding/base64"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// A list filtered by a condition passes the backend's page token on
// sealed: a backend's token may name the last object of the page (the
// simulator's does), which may be someone else's. The token is encrypted
// and authenticated (AES-GCM, a key made at start) with the method and the
// caller's identity as additional data, so it can be neither read nor used
// by another principal; it is valid on the agent that issued it, until it
// restarts.
const tokenPrefix = "pvg1."

func newTokenCipher() (cipher.AEAD, error) {
	key := make([]byte, 32)
	if _, err := rand.Read(key); err != nil {
		return nil, err
	}
	block, err := aes.NewCipher(key)
	if err != nil {
		return nil, err
	}
	return cipher.NewGCM(block)
}

func (gr *grant) tokenAAD() []byte { return []byte(gr.m.full + "\x00" + gr.who.Identity) }

// sealPageToken replaces a filtered list response's next_page_token.
func (g *Guard) sealPageToken(gr *grant, resp protoreflect.Message) {
	fd := resp.Descriptor().Fields().ByName("next_page_token")
	if fd == nil || fd.Kind() != protoreflect.StringKind || fd.IsList() || resp.Get(fd).String() == "" {
		return
	}
	nonce := make([]byte, g.tokens.NonceSize())
	if _, err := rand.Read(nonce); err != nil {
		resp.Clear(fd) // no token rather than the backend's
		return
	}
	sealed := g.tokens.Seal(nonce, nonce, []byte(resp.Get(fd).String()), gr.tokenAAD())
	resp.Set(fd, protoreflect.ValueOfString(tokenPrefix+base64.RawURLEncoding.EncodeToString(sealed)))
}

// openPageToken replaces a filtered list request's page_token with the
// backend's token it sealed.
func (g *Guard) openPageToken(gr *grant, req protoreflect.Message) error {
	fd := req.Descriptor().Fields().ByName("page_token")
	if fd == nil || fd.Kind() != protoreflect.StringKind || fd.IsList() || req.Get(fd).String() == "" {
		return nil
	}
	bad := &denial{code: codes.InvalidArgument, msg: "page_token: not a token this agent issued to you (the tokens of a filtered list are valid on the agent that issued them, until it restarts); list again without one"}
	raw, ok := strings.CutPrefix(req.Get(fd).String(), tokenPrefix)
	if !ok {
		return bad
	}
	sealed, err := base64.RawURLEncoding.DecodeString(raw)
	if err != nil || len(sealed) < g.tokens.NonceSize() {
		return bad
	}
	plain, err := g.tokens.Open(nil, sealed[:g.tokens.NonceSize()], sealed[g.tokens.NonceSize():], gr.tokenAAD())
	if err != nil {
		return bad
	}
	req.Set(fd, protoreflect.ValueOfString(string(plain)))
	return nil
}

// filterResponse filters a conditional list's response and seals its page
// token; false: a watch event not to send.
func (g *Guard) filterResponse(gr *grant, resp protoreflect.Message) bool {
	if !gr.filter(resp) {
		return false
	}
	g.sealPageToken(gr, resp)
	return true
}

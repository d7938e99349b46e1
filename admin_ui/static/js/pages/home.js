// /ui: straight to the signed-in user's home, or to sign-in.

import { currentSession } from "../lib/api.js";
import { HOMES } from "../lib/shell.js";

const session = currentSession();
window.location.replace(session ? HOMES[session.identity.role] : "/ui/signin");
